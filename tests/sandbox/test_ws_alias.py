"""Workspace aliases (``sandbox/wsalias.py``) last as long as the calls through them.

A workspace under a 0700 parent reaches ``shell`` through a bind mount at
``/run/corral/workspaces/<gid>/ws``. These tests run real calls on real workers
(one broker, two workers of capacity 1, so two calls in flight run on both) and
read the host's mount table: the alias exists while a call runs, is gone when
the last call through it ends (on whichever worker), so the workspace can be
removed; a SIGKILLed worker's alias goes at the next worker's start.

Each call waits for a file the test creates (``go-<name>``), so "in flight" is
a condition, not a sleep; the test creates it on every path."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.client import BrokerClient
from broker.errors import RequestFailed
from sandbox_worker.sandbox import wsalias
from tests.helpers import Procs, eventually, searchable_dir
from tests.sandbox.conftest import (
    CallResult,
    Stack,
    shell,
    start_stack,
    start_worker,
    stop_all,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A broker and two T2 tool workers of capacity 1 (the conftest's ``client``
    talks to it)."""
    procs = Procs(tmp_path_factory.mktemp("alias-stack"))
    try:
        first = start_stack(procs, "T2", "--capacity", "1")
        start_worker(procs, first.backend, "T2", "--capacity", "1", name="worker-b")
        yield first
    finally:
        stop_all(procs)


@contextlib.contextmanager
def private_workspace() -> Iterator[Path]:
    """A workspace under a 0700 parent (the sandbox cannot search it); an
    alias a failed test left on it is detached afterwards."""
    with searchable_dir("corral-alias-", "/tmp") as parent:
        os.chmod(parent, 0o700)
        ws = parent / "proj"
        ws.mkdir()
        try:
            yield ws
        finally:
            for point in aliases_of(ws):
                wsalias._detach(point)


def aliases_of(ws: Path) -> list[str]:
    """The alias mount points of ``ws`` in the host's mount table."""
    try:
        st = ws.stat()
    except FileNotFoundError:
        return []  # removed
    found = []
    for point in wsalias._mount_points():
        if point.startswith(wsalias.ALIAS_ROOT + "/"):
            with contextlib.suppress(OSError):
                seen = os.stat(point)
                if (seen.st_dev, seen.st_ino) == (st.st_dev, st.st_ino):
                    found.append(point)
    return found


def held(client: BrokerClient, ws: Path, name: str) -> asyncio.Task[CallResult]:
    """A shell call through the alias that runs until the test creates ``go-<name>``
    (bounded by its budget)."""
    command = f"touch started-{name}; while [ ! -e go-{name} ]; do sleep 0.02; done; echo {name}"
    return asyncio.ensure_future(shell(client, command, ws, timeout_s=60))


async def started(ws: Path, name: str) -> None:
    async def there() -> bool:
        return (ws / f"started-{name}").exists()
    await eventually(there, timeout_s=30, what=f"call {name} to start")


async def finish(call: asyncio.Task[CallResult], ws: Path, name: str) -> None:
    (ws / f"go-{name}").touch()
    r = await call
    assert r.result["outcome"] == "ok", r.result["output"]


async def test_the_alias_goes_with_the_call_and_the_workspace_can_be_removed(
        client: BrokerClient) -> None:
    with private_workspace() as ws:
        call = held(client, ws, "a")
        try:
            await started(ws, "a")
            assert len(aliases_of(ws)) == 1  # the call goes through an alias
        finally:
            await finish(call, ws, "a")
        assert aliases_of(ws) == []
        shutil.rmtree(ws)  # nothing holds it: no EBUSY, no mount left on it
        assert not ws.exists()


async def test_two_calls_on_two_workers_keep_the_alias_until_both_end(
        client: BrokerClient) -> None:
    with private_workspace() as ws:
        first, second = held(client, ws, "a"), held(client, ws, "b")
        try:
            # Both in flight at once: with capacity 1 each, on both workers.
            await started(ws, "a")
            await started(ws, "b")
            assert len(aliases_of(ws)) == 1
            await finish(first, ws, "a")
            assert len(aliases_of(ws)) == 1, "detached while a call still runs through it"
            r = await shell(client, "cat started-a && ls", ws)  # a third call meanwhile
            assert r.result["outcome"] == "ok", r.result["output"]
            assert len(aliases_of(ws)) == 1
        finally:
            for name, call in (("a", first), ("b", second)):
                if not call.done():
                    await finish(call, ws, name)
        assert aliases_of(ws) == []


async def test_a_killed_workers_alias_goes_at_the_next_start_a_stopped_ones_at_its_stop(
        stack: Stack, client: BrokerClient) -> None:
    """A worker SIGKILLed mid-call holds nothing any more but releases nothing
    either: the next worker to start detaches the alias it left. A worker
    stopped gracefully mid-call (SIGTERM) ends the call and detaches it."""
    procs = stack.procs
    victim, _ = start_worker(procs, stack.backend, "T2", "--capacity", "1",
                             name="worker-victim")
    with private_workspace() as ws, searchable_dir("corral-busy-", "/tmp") as busy:
        # The stack's two workers busy elsewhere: the calls on ws land on the
        # victim, then on the next worker.
        blockers = [held(client, busy, n) for n in ("x", "y")]
        try:
            await started(busy, "x")
            await started(busy, "y")
            call = held(client, ws, "v")
            await started(ws, "v")
            assert len(aliases_of(ws)) == 1
            os.kill(victim.pid, signal.SIGKILL)  # its sandbox dies with it
            await asyncio.to_thread(victim.wait, 10)
            (ws / "go-v").touch()
            with pytest.raises(RequestFailed, match="worker_lost"):
                await call
            # Nothing of the dead worker released it, but any worker's start on this
            # host sweeps unheld aliases: in a parallel run another test's worker may
            # already have (the full suite once did). Without sweeps at start the
            # assertion after the next start fails either way.
            assert len(aliases_of(ws)) <= 1
            following, _ = start_worker(procs, stack.backend, "T2", "--capacity", "1",
                                        name="worker-next")
            assert aliases_of(ws) == [], "the next worker's start left the dead one's alias"

            call = held(client, ws, "s")
            await started(ws, "s")
            assert len(aliases_of(ws)) == 1
            following.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(following.wait, 30) == 0
            with pytest.raises(RequestFailed, match="worker_lost"):
                await call  # cancelled by the stop
            assert aliases_of(ws) == [], "a worker's graceful stop left its call's alias"
        finally:
            for n in ("v", "s"):
                (ws / f"go-{n}").touch()
            for n in ("x", "y"):
                (busy / f"go-{n}").touch()
            await asyncio.gather(*blockers)
