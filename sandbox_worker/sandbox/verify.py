"""Isolation records derived from what the kernel shows inside the sandbox.

A record must never say what was *configured*; it says what a process at the
end of the very same argv chain saw. ``probe.py`` is run as the command of a
real chain (``Profile.build``) and reports its ``/proc/self/status`` lines
(Seccomp, NoNewPrivs, Uid, Gid, Groups, capabilities), its namespaces, its
rlimits, and whether a denied syscall (``unshare(0)``, a no-op otherwise),
an ``AF_VSOCK`` socket, an ``AF_INET`` socket and a write to a world-writable
host directory outside the workspace were refused; then it waits while the
worker reads its ``/proc/<pid>/ns/*`` and ``/proc/<pid>/cgroup`` from the
host side (``run_probe``; this works at T2-, which has no /proc inside).
``shortfalls`` compares all that with what the tier promises;
``Profile.isolation`` turns it into the record's fields and ``kernel_facts``
into its evidence.

Cost: a chain is probed when tier detection tries it and whenever a call's
chain has a *shape* (its argv with the per-call values -- uid, limits,
paths, fds, call id -- masked, ``chain_shape``) that was not probed yet, e.g.
the first network grant. A call whose shape was probed costs one masking of
its argv and a dict look-up.

Invariants:
- A fact the probe could not observe is never reported as applied: the
  record then says ``false``/``host`` and lists why in ``degraded``.
- A chain whose probe shows a shortfall of its tier never runs a tool: tier
  detection drops the tier, and a call gets a ``sandbox_unavailable`` error.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import psutil

from sandbox_worker.api import KernelFacts, Tier, ToolLimits
from sandbox_worker.sandbox.reaper import MANAGED_HEADS, spawning

PROBE_SOURCE: Final = Path(__file__).with_name("probe.py").read_text()
PROBE_TIMEOUT_S: Final = 20.0
NAMESPACES: Final = ("user", "pid", "net", "mnt", "ipc", "uts", "cgroup")
# What each tier's bwrap (--unshare-all --unshare-user) separates; "net" only
# without a network grant.
T2_NAMESPACES: Final = ("user", "pid", "mnt", "ipc", "uts", "cgroup")
# The rlimits the chain's prlimit link applies, by the probe's name.
RLIMIT_OF: Final = {"cpu": "cpu_s", "as": "address_space_bytes", "nproc": "processes",
                    "fsize": "file_size_bytes", "nofile": "open_files"}
RLIM_INFINITY: Final = -1
_PRLIMIT_VALUE = re.compile(r"^(--[a-z-]+=)[0-9][0-9:]*$")


def host_namespaces() -> dict[str, str]:
    """The worker's own namespaces, to compare the probe's with."""
    out: dict[str, str] = {}
    for name in NAMESPACES:
        try:
            out[name] = os.readlink(f"/proc/self/ns/{name}")
        except OSError:
            continue
    return out


def chain_shape(head: Sequence[str], variable: Iterable[str],
                mask_after: Iterable[str] = ("--chdir",)) -> tuple[str, ...]:
    """``head`` (the chain's argv before the command) with every per-call value
    masked: tokens equal to one of ``variable`` (or ``--opt=`` one of them),
    the token after each option in ``mask_after`` (the working directory), and
    numeric ``--opt=N[:M]`` tokens (prlimit's). Two calls with equal shapes run
    under the same layers. A numeric option is always ``<n>``, whatever it equals:
    a busy worker's fd numbers reach the limits' values, and ``--nproc=64`` once
    came out ``<v>`` in a call whose pass fd was 64 and ``<n>`` in its probe, so
    the call was refused as unlike the chain probed for it."""
    after = set(mask_after)
    values = {v for v in variable if v}
    out: list[str] = []
    append = out.append
    for token in head:
        if token in values or (out and out[-1] in after):
            append("<v>")
        elif token[:2] == "--" and "=" in token:
            opt, _, value = token.partition("=")
            if _PRLIMIT_VALUE.match(token):
                append(f"{opt}=<n>")
            elif value in values:
                append(f"{opt}=<v>")
            else:
                append(token)
        else:
            append(token)
    return tuple(out)


@dataclass(frozen=True)
class Expect:
    """What the probed chain was built to apply."""

    tier: Tier
    uid: int
    gid: int
    limits: ToolLimits
    network: bool
    cgroup_mark: str = ""  # e.g. "/corral/worker-<pid>" when the worker cgroup applied
    cgroup_count: int = 0  # how many hierarchies the chain joins (v1: memory and pids)


@dataclass(frozen=True)
class KernelView:
    """The probe's report (see probe.py), parsed."""

    seccomp_mode: int  # 0 off, 2 filter (PR_GET_SECCOMP; /proc's Seccomp line agrees)
    seccomp_filters: int | None  # /proc's Seccomp_filters, when /proc is there
    no_new_privs: bool
    uids: tuple[int, ...]  # real, effective, saved (+ filesystem from /proc)
    gids: tuple[int, ...]
    groups: tuple[int, ...]
    cap_eff: int | None  # None without /proc
    cap_bnd: int | None
    namespaces: dict[str, str]  # as the probe read them; empty without /proc
    interfaces: list[str] | None  # None when netlink is refused (T1)
    rlimits: dict[str, tuple[int, int]]
    errnos: dict[str, int]  # 0: the operation worked
    outside: dict[str, str] = field(default_factory=dict)  # the host's view of them
    cgroups: str = ""  # the host's /proc/<pid>/cgroup of the probe ("" if unread)

    @classmethod
    def parse(cls, text: str) -> KernelView:
        """Raises ``ValueError`` on anything but the probe's one JSON line."""
        try:
            lines = [ln for ln in text.splitlines() if ln.startswith("{")]
            raw = json.loads(lines[-1])
            status: dict[str, list[str]] | None = raw["status"]
            ids = raw["ids"]
            uids = [int(u) for u in ids["uid"]]
            gids = [int(g) for g in ids["gid"]]
            cap_eff = cap_bnd = filters = None
            mode = int(raw["prctl"]["seccomp"])
            nnp = int(raw["prctl"]["no_new_privs"]) == 1
            if status is not None:
                uids = [int(u) for u in status["Uid"]]
                gids = [int(g) for g in status["Gid"]]
                cap_eff = int(status["CapEff"][0], 16)
                cap_bnd = int(status["CapBnd"][0], 16)
                filters = int(status.get("Seccomp_filters", ["0"])[0])
                if int(status["Seccomp"][0]) != mode or (int(status["NoNewPrivs"][0]) == 1) != nnp:
                    raise ValueError("/proc/self/status and prctl disagree")
            return cls(
                seccomp_mode=mode, seccomp_filters=filters, no_new_privs=nnp,
                uids=tuple(uids), gids=tuple(gids),
                groups=tuple(int(g) for g in ids["groups"]), cap_eff=cap_eff, cap_bnd=cap_bnd,
                namespaces={str(k): str(v) for k, v in raw["ns"].items()},
                interfaces=(None if raw["interfaces"] is None
                            else [str(i) for i in raw["interfaces"]]),
                rlimits={str(k): (_lim(v[0]), _lim(v[1])) for k, v in raw["rlimits"].items()},
                errnos={str(k): int(v) for k, v in raw["errno"].items()})
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"unreadable probe report: {text[:200]!r} ({exc})") from exc

    @property
    def seen_ns(self) -> dict[str, str]:
        """The probe's namespaces: the host's view of them when it was read
        (it works without /proc inside, at T2-), else the probe's own."""
        return self.outside or self.namespaces

    def separate(self, host: dict[str, str]) -> list[str]:
        """Namespaces the probe was in that differ from the worker's."""
        seen = self.seen_ns
        return [n for n in NAMESPACES if n in seen and n in host and seen[n] != host[n]]

    @property
    def seccomp_in_force(self) -> bool:
        return self.seccomp_mode == 2 and self.errnos.get("unshare") == errno.EPERM


def _lim(value: Any) -> int:
    v = int(value)
    return RLIM_INFINITY if v < 0 or v >= 2**63 - 1 else v


def expected_rlimits(limits: ToolLimits) -> dict[str, tuple[int, int]]:
    """What prlimit_argv(limits) sets, in the probe's terms."""
    cpu = int(limits["cpu_s"])
    out = {"cpu": (cpu, cpu + 1), "core": (0, 0)}
    for probe_name, key in RLIMIT_OF.items():
        if probe_name != "cpu":
            value = int(limits[key])  # type: ignore[literal-required]
            out[probe_name] = (value, value)
    return out


def shortfalls(view: KernelView, expect: Expect, host: dict[str, str]) -> list[str]:
    """What ``expect.tier`` promises that the kernel did not show; empty if all held."""
    tier = expect.tier
    out: list[str] = []
    if set(view.uids) != {expect.uid}:
        out.append(f"uid drop not in force: uids {list(view.uids)}, expected {expect.uid}")
    if set(view.gids) != {expect.gid} or not set(view.groups) <= {expect.gid}:
        out.append(f"gid drop not in force: gids {list(view.gids)} groups "
                   f"{list(view.groups)}, expected {expect.gid}")
    if view.cap_eff:
        out.append(f"capabilities not dropped: CapEff {view.cap_eff:#x}")
    if not view.no_new_privs:
        out.append("no_new_privs not set (NoNewPrivs: 0)")
    want = expected_rlimits(expect.limits)
    for name, pair in want.items():
        got = view.rlimits.get(name)
        if got != pair:
            out.append(f"RLIMIT_{name.upper()} not applied: {_fmt(got)}, expected {_fmt(pair)}")
    if expect.cgroup_mark:
        joined = sum(1 for line in view.cgroups.splitlines()
                     if line.endswith(expect.cgroup_mark))
        if joined < expect.cgroup_count:
            out.append(f"worker cgroup not joined: {joined} of {expect.cgroup_count} "
                       f"hierarchies show {expect.cgroup_mark}")
    if tier == "T0":
        return out
    if not view.seccomp_in_force:
        out.append(f"seccomp filter not in force (Seccomp: {view.seccomp_mode}, unshare(0): "
                   f"{_errname(view.errnos.get('unshare', -1))})")
    if view.errnos.get("socket_vsock") == 0:
        out.append("AF_VSOCK sockets can be created")
    if view.errnos.get("host_write") == 0:
        out.append("a world-writable host directory outside the workspace is writable")
    if tier == "T1" and not expect.network and view.errnos.get("socket_inet") == 0:
        out.append("AF_INET sockets can be created without a network grant")
    if tier in ("T2", "T2-"):
        seen = view.seen_ns
        if not seen:
            out.append("the probe's namespaces could not be read")
        sep = set(view.separate(host))
        wanted = set(T2_NAMESPACES) | (set() if expect.network else {"net"})
        missing = sorted(wanted - sep)
        if seen and missing:
            out.append(f"namespaces shared with the worker: {', '.join(missing)}")
        both = set(view.outside) & set(view.namespaces)
        if any(view.outside[n] != view.namespaces[n] for n in both):
            out.append("the probe's own /proc/self/ns differs from the host's view of it")
    return out


def _fmt(pair: tuple[int, int] | None) -> str:
    if pair is None:
        return "unreadable"
    return ":".join("unlimited" if v == RLIM_INFINITY else str(v) for v in pair)


def _errname(code: int) -> str:
    if code == 0:
        return "allowed"
    return errno.errorcode.get(code, str(code))


def kernel_facts(view: KernelView, expect: Expect, host: dict[str, str], uid: int,
                 gid: int | None = None) -> KernelFacts:
    """The record's evidence. The probe ran as a uid and gid of its own
    (``expect``); where the kernel showed exactly those, the call's ``uid`` and
    ``gid`` (its workspace's group; masked in the shape) are shown."""
    call_gid = expect.gid if gid is None else gid
    return KernelFacts(
        seccomp_mode=view.seccomp_mode, no_new_privs=view.no_new_privs,
        uids=[uid if u == expect.uid else u for u in view.uids],
        gids=[call_gid if g == expect.gid else g for g in view.gids],
        cap_eff=None if view.cap_eff is None else f"{view.cap_eff:#x}",
        namespaces=view.separate(host),
        denied=sorted(k for k, v in view.errnos.items() if v > 0))


async def run_probe(argv: list[str], env: dict[str, str], pass_fds: Sequence[int],
                    marker: str = "", timeout_s: float = PROBE_TIMEOUT_S,
                    ) -> tuple[int, str, str, dict[str, str], str]:
    """Run a probe chain to its end, bounded: (exit code, stdout, stderr, the
    probe's namespaces and cgroups read from the host). With ``marker`` (the probe was
    given ``--hold MARKER``), once the report line is out the probe process is
    found among the head's descendants by its marker and its
    ``/proc/<pid>/ns/*`` and ``cgroup`` read, then its stdin is closed. Closes ``pass_fds``
    once started."""
    try:
        with spawning():
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=env, pass_fds=tuple(pass_fds),
                cwd="/", start_new_session=True)  # as process.run: not the worker's
            MANAGED_HEADS.add(proc.pid)
    except OSError as exc:
        return 127, "", f"{argv[0]}: {exc.strerror}", {}, ""
    finally:
        for fd in pass_fds:
            os.close(fd)
    outside: dict[str, str] = {}
    cgroups = ""
    try:
        async with asyncio.timeout(timeout_s):
            first = b""
            if marker and proc.stdout is not None:
                first = await proc.stdout.readline()
                if first.startswith(b"{"):
                    outside, cgroups = _host_view(proc.pid, marker)
            if proc.stdin is not None:
                proc.stdin.close()
            out, err = await proc.communicate()
            out = first + out
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return 124, "", "probe timed out", {}, ""
    finally:
        MANAGED_HEADS.discard(proc.pid)
    code = proc.returncode if proc.returncode is not None else 1
    return (code, out.decode(errors="replace"), err.decode(errors="replace").strip(), outside,
            cgroups)


def _host_view(head: int, marker: str) -> tuple[dict[str, str], str]:
    """The namespaces and the cgroup file of the descendant of ``head`` whose
    argv holds ``marker``, as the host sees them (empty if it is not found)."""
    try:
        for child in psutil.Process(head).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if marker in child.cmdline():
                    out: dict[str, str] = {}
                    for name in NAMESPACES:
                        with contextlib.suppress(OSError):
                            out[name] = os.readlink(f"/proc/{child.pid}/ns/{name}")
                    cgroups = ""
                    with contextlib.suppress(OSError), open(f"/proc/{child.pid}/cgroup") as f:
                        cgroups = f.read(65536)
                    return out, cgroups
    except psutil.Error:
        pass
    return {}, ""
