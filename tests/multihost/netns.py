"""Hosts for a test: network namespaces joined to a broker host by veth pairs.

Topology (all addresses inside these namespaces only; the host's own network
is never touched, and nothing is routed out of them)::

    sup  10.77.1.2 ──veth── 10.77.1.1 ┐
    w1   10.77.2.2 ──veth── 10.77.2.1 ├ brk (10.77.0.1 on its lo: the farm's address)
    w2   10.77.3.2 ──veth── 10.77.3.1 ┘

Every other host routes 10.77.0.0/24 via its link, so the broker and the
scripted provider, bound in ``brk``, are reached at 10.77.0.1 from everywhere.
Each host gets its own UTS namespace (``unshare --uts``) so processes report
their host's name. ``ip netns del`` removes the namespaces and their veths.
"""

from __future__ import annotations

import contextlib
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

FARM_ADDR = "10.77.0.1"
_LINKS = {"sup": 1, "w1": 2, "w2": 3}


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")


@dataclass
class Hosts:
    tag: str

    def ns(self, host: str) -> str:
        return f"cmh-{self.tag}-{host}"

    def prefix(self, host: str) -> list[str]:
        """Run a command on ``host``: in its netns and its own UTS namespace."""
        return ["ip", "netns", "exec", self.ns(host), "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', host]

    def addr(self, host: str) -> str:
        return FARM_ADDR if host == "brk" else f"10.77.{_LINKS[host]}.2"

    def link(self, host: str, up: bool) -> None:
        """Cut (or heal) ``host``'s only link, on the host's side."""
        _ip("-n", self.ns(host), "link", "set", f"v{host}", "up" if up else "down")
        if up:  # the kernel flushed the route through the link when it went down
            n = _LINKS[host]
            _ip("-n", self.ns(host), "route", "replace", "10.77.0.0/24", "via", f"10.77.{n}.1")


def _build(h: Hosts) -> None:
    for host in ("brk", *_LINKS):
        _ip("netns", "add", h.ns(host))
        _ip("-n", h.ns(host), "link", "set", "lo", "up")
    _ip("-n", h.ns("brk"), "addr", "add", f"{FARM_ADDR}/32", "dev", "lo")
    for host, n in _LINKS.items():
        _ip("-n", h.ns("brk"), "link", "add", f"b{host}", "type", "veth", "peer", "name",
            f"v{host}", "netns", h.ns(host))
        _ip("-n", h.ns("brk"), "addr", "add", f"10.77.{n}.1/24", "dev", f"b{host}")
        _ip("-n", h.ns(host), "addr", "add", f"10.77.{n}.2/24", "dev", f"v{host}")
        _ip("-n", h.ns("brk"), "link", "set", f"b{host}", "up")
        _ip("-n", h.ns(host), "link", "set", f"v{host}", "up")
        _ip("-n", h.ns(host), "route", "add", "10.77.0.0/24", "via", f"10.77.{n}.1")


def _teardown(h: Hosts) -> None:
    for host in ("brk", *_LINKS):
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            _ip("netns", "del", h.ns(host))


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    """Four hosts for this test (xdist-safe unique names), always removed afterwards."""
    h = Hosts(uuid.uuid4().hex[:8])
    try:
        _ip("netns", "add", h.ns("probe"))
        _ip("netns", "del", h.ns("probe"))
    except (RuntimeError, FileNotFoundError) as exc:
        pytest.skip(f"network namespaces are not available here: {exc}")
    try:
        _build(h)
        yield h
    finally:
        _teardown(h)
