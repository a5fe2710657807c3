"""Process-tree kill, proven at every tier this machine can produce.

The command ignores SIGTERM everywhere (an inherited SIG_IGN survives exec)
and leaves processes behind in every way a shell can: a double-forked
daemon in a new session, a double-forked grandchild, a grandchild whose
parent is still there, and itself. Every one carries a marker in its argv
(``exec -a``). Each stack gets a uid range of its own, so "nothing
outlives" is checked on the host's process table both by uid and by marker.

(a) a CANCEL must end all of it within the grace period plus a margin, and
the worker must go on serving; (b) a SIGKILLed worker must leave nothing
behind either.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import tempfile
import uuid
from pathlib import Path

import psutil
import pytest

from broker.client import BrokerClient, Call
from broker.errors import RequestFailed
from broker.protocol import unpack
from sandbox_worker.api import Tier
from sandbox_worker.sandbox.limits import DEFAULT_LIMITS
from sandbox_worker.sandbox.process import RunSpec, run
from sandbox_worker.sandbox.profile import Profile
from sandbox_worker.sandbox.seccomp import SeccompFilters
from sandbox_worker.sandbox.user import SandboxUser
from tests.helpers import Procs
from tests.sandbox.conftest import HB_S, Stack, request_body, shell, start_or_skip

pytestmark = pytest.mark.sandbox

TIERS: list[Tier] = ["T2", "T2-", "T1", "T0"]
GRACE_S = 1.0
# Behaviour: SIGTERM, the grace period, SIGKILL, reaping. The margin is for
# a loaded CI machine (2 cores, five suites at once), not for slowness.
CANCEL_BOUND_S = GRACE_S + 4.0
WORKER_DEATH_BOUND_S = 5.0
RANGE_SIZE = 8


def command(marker: str) -> str:
    return ("trap '' TERM; "
            f"(setsid bash -c 'exec -a {marker}-daemon sleep 600' &); "
            f"(bash -c '(exec -a {marker}-orphan sleep 600 &); exec -a {marker}-parent sleep 600'"
            " &); "
            f"bash -c 'exec -a {marker}-child sleep 600' & "
            f"echo started; exec -a {marker}-head sleep 600")


def left_behind(uids: range, marker: str) -> list[tuple[int, str]]:
    """Live processes on the host with a uid of ``uids`` or ``marker`` in argv."""
    found = []
    for p in psutil.process_iter(["uids", "cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            ids = p.info["uids"]
            argv = " ".join(p.info["cmdline"] or [])
            if marker in argv or any(u in uids for u in (ids.real, ids.effective, ids.saved)):
                found.append((p.pid, argv))
        except psutil.Error:
            continue
    return found


async def until_gone(uids: range, marker: str, bound_s: float) -> float:
    """Seconds until nothing of ``uids``/``marker`` is alive; fails past ``bound_s``."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while left := left_behind(uids, marker):
        if loop.time() - start > bound_s:
            raise AssertionError(f"still alive {bound_s} s later: {left}")
        await asyncio.sleep(0.05)
    return loop.time() - start


def own_range(tier: str) -> range:
    """A uid range no other test or worker uses (its own lock files too)."""
    start = 4_000_000 + (os.getpid() % 4096) * 64 + TIERS.index(tier) * RANGE_SIZE * 2
    return range(start, start + RANGE_SIZE)


def start(procs: Procs, tier: str, uids: range) -> Stack:
    # The range's lock files live with the test, not in the host's lock directory.
    extra = ["--tool-grace-s", str(GRACE_S), "--sandbox-uid-range",
             f"{uids.start}:{len(uids)}", "--sandbox-uid-lock-dir",
             str(procs.log_dir / "uid-locks")]
    if tier == "T0":
        extra.append("--allow-unsandboxed")
    return start_or_skip(procs, tier, *extra)


async def start_call(client: BrokerClient, workspace: Path, marker: str,
                     uids: range) -> Call:
    call = client.start("tool", request_body("shell", {"command": command(marker)}, workspace,
                                             call_id=f"kill-{uuid.uuid4().hex[:8]}"),
                        budget_s=120)
    seen = b""
    async with asyncio.timeout(20):
        async for chunk in call:
            seen += unpack(chunk)["data"]
            if b"started" in seen:
                break
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while True:
        names = " ".join(a for _, a in left_behind(uids, marker))
        if all(f"{marker}-{n}" in names for n in ("daemon", "orphan", "parent", "child",
                                                  "head")):
            return call
        assert loop.time() < deadline, left_behind(uids, marker)
        await asyncio.sleep(0.05)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("tier", TIERS)
async def test_cancel_ends_a_term_ignoring_double_forked_tree(
        stack_procs: Procs, workspace: Path, tier: str) -> None:
    uids = own_range(tier)
    st = start(stack_procs, tier, uids)
    marker = f"corral-kill-{tier}-{uuid.uuid4().hex[:8]}"
    async with BrokerClient(st.frontend, heartbeat_interval_s=HB_S) as client:
        call = await start_call(client, workspace, marker, uids)
        await call.cancel()
        took = await until_gone(uids, marker, CANCEL_BOUND_S)
        assert took <= CANCEL_BOUND_S
        after = await shell(client, "echo still-serving", workspace, timeout_s=30)
        assert after.result["outcome"] == "ok", after.result["output"]
    assert left_behind(uids, marker) == []


@pytest.mark.timeout(90)
@pytest.mark.parametrize("tier", TIERS)
async def test_killed_worker_leaves_nothing_of_such_a_tree(
        stack_procs: Procs, workspace: Path, tier: str) -> None:
    uids = own_range(tier)
    st = start(stack_procs, tier, uids)
    marker = f"corral-orphan-{tier}-{uuid.uuid4().hex[:8]}"
    async with BrokerClient(st.frontend, heartbeat_interval_s=HB_S) as client:
        call = await start_call(client, workspace, marker, uids)
        st.worker.kill()  # SIGKILL: none of the worker's clean-up runs
        await until_gone(uids, marker, WORKER_DEATH_BOUND_S)
        with pytest.raises(RequestFailed):
            await call.result()


# -- the kill path on its own: no broker, no worker subreaper ------------------
#
# In a worker, orphans that a broken kill path misses may still be caught by
# the worker's subreaper sweep (reaper.py). Here nothing else helps: the test
# fails if kill_tree itself does not end the whole tree, at every tier.

@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["cancel", "timeout"])
@pytest.mark.parametrize("tier", TIERS)
def test_kill_tree_alone_ends_the_tree(user: SandboxUser, filters: SeccompFilters,
                                       tier: Tier, how: str) -> None:
    uid = own_range(tier)[RANGE_SIZE - 1] + RANGE_SIZE  # outside the stacks' ranges
    marker = f"corral-alone-{tier}-{how}-{uuid.uuid4().hex[:8]}"
    ws = tempfile.mkdtemp(prefix="corral-kill-", dir="/var/tmp")
    os.chown(ws, uid, user.gid)
    chain = Profile(tier, user, filters, None).build(
        ["/bin/bash", "-c", command(marker)], ws, DEFAULT_LIMITS, network=False, uid=uid,
        tmpdir=ws)
    wall_s = 3.0 if how == "timeout" else 60.0
    spec = RunSpec(chain.argv, chain.env, wall_s, 1 << 20, chain.pass_fds, grace_s=GRACE_S,
                   uid=uid)

    async def go() -> float:
        started = asyncio.Event()

        async def on_chunk(stream: str, data: bytes) -> None:
            started.set()

        task = asyncio.create_task(run(spec, on_chunk))
        try:
            async with asyncio.timeout(20):
                await started.wait()
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            if how == "cancel":
                task.cancel()
            # Past this bound the kill path hangs (asyncio waits for the pipes
            # the survivors hold): that is the failure.
            async with asyncio.timeout(CANCEL_BOUND_S + (wall_s if how == "timeout" else 0)):
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            return loop.time() - t0
        finally:
            for pid, _ in left_behind(range(uid, uid + 1), marker):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)  # clean up after a failed kill path

    try:
        left: list[tuple[int, str]] = []

        async def checked() -> float:
            took = await go()
            left.extend(left_behind(range(uid, uid + 1), marker))
            return took

        took = asyncio.run(checked())
    finally:
        for fd in chain.pass_fds:
            os.close(fd)
        shutil.rmtree(ws, ignore_errors=True)
    assert left == []
    assert took <= CANCEL_BOUND_S + (wall_s if how == "timeout" else 0)
