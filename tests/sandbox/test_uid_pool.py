"""Per-call sandbox uids (sandbox/uidpool.py): one call's fork bomb cannot
starve other calls, files stay shared across call uids, a uid is never reused
while a process of it lives, and two workers never hold the same uid.

Real processes throughout: the pool against other processes holding locks or
running as a uid, and real brokers and workers for the end-to-end cases.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from broker.client import BrokerClient
from broker.errors import RequestFailed
from broker.protocol import FailureKind
from sandbox_worker.sandbox.uidpool import UidPool, parse_range, uids_present
from sandbox_worker.sandbox.user import ensure_user
from tests.helpers import Procs, read_line_with_deadline, wait_until
from tests.sandbox.conftest import (
    HB_S,
    Stack,
    call_processes,
    call_tool,
    host_read,
    no_call_processes,
    request_body,
    shell,
    start_stack,
)

pytestmark = pytest.mark.sandbox


def _narrow_range() -> int:
    """A start uid far from the default range and from other tests' ranges."""
    return random.randrange(3_000_000, 3_900_000, 64)


@pytest.fixture
def stacks(procs: Procs) -> Iterator[Callable[..., Stack]]:
    """Starts stacks (broker + worker, T2 unless ``tier=``); closes their pipes
    at the end."""
    yield lambda *extra, tier="T2": start_stack(procs, tier, *extra)
    for proc in procs.started:
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.fixture
def gid() -> int:
    return asyncio.run(ensure_user()).gid


def _as_uid(procs: Procs, uid: int, gid: int, name: str) -> psutil.Process:
    proc = procs.spawn(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
                        "--", "sleep", "120"], name=name)
    p = psutil.Process(proc.pid)
    wait_until(lambda: p.uids().real == uid, what=f"process to become uid {uid}")
    return p


def test_parse_range() -> None:
    assert parse_range("200000:65536") == (200000, 65536)
    for bad in ("0:10", "5", "a:b", "10:0", "-1:3", "4294967294:10"):
        with pytest.raises(ValueError, match="uid range"):
            parse_range(bad)


def test_setup_refuses_a_range_with_a_user(tmp_path: Path, gid: int) -> None:
    from sandbox_worker.sandbox.errors import SandboxSetupError

    with pytest.raises(SandboxSetupError, match="belongs to a user"):
        UidPool(1, 100_000, gid, str(tmp_path / "locks")).setup()  # includes uid 999 etc.


def test_lock_held_by_another_process_is_skipped_until_it_dies(
        procs: Procs, tmp_path: Path, gid: int) -> None:
    start, locks = _narrow_range(), str(tmp_path / "locks")
    code = ("import sys, time; from sandbox_worker.sandbox.uidpool import UidPool; "
            f"p = UidPool({start}, 2, {gid}, {locks!r}); p.setup(); l = p.try_acquire(); "
            "print(l.uid, flush=True); import signal; signal.pause()")
    other = procs.spawn([sys.executable, "-c", code], name="other-worker",
                        stdout=subprocess.PIPE)
    held = int(read_line_with_deadline(other, 20.0))
    pool = UidPool(start, 2, gid, locks)
    pool.setup()
    try:
        mine = pool.try_acquire()
        assert mine is not None
        assert mine.uid != held
        assert pool.try_acquire() is None  # the other worker's uid is never handed out
        os.kill(other.pid, signal.SIGKILL)  # a SIGKILLed worker leaks no lock
        other.wait(timeout=10)
        again = pool.try_acquire()
        assert again is not None
        assert again.uid == held
    finally:
        pool.close()
        if other.stdout is not None:
            other.stdout.close()


def test_uid_is_never_reused_while_a_process_of_it_lives(
        procs: Procs, tmp_path: Path, gid: int) -> None:
    start = _narrow_range()
    pool = UidPool(start, 2, gid, str(tmp_path / "locks"))
    pool.setup()
    try:
        # A leftover of a killed call (or of anything) running as `start`.
        leftover = _as_uid(procs, start, gid, "leftover")
        assert start in uids_present(start, start + 2)
        lease = pool.try_acquire()
        assert lease is not None
        assert lease.uid == start + 1
        assert pool.try_acquire() is None
        # Released while a process of its uid still lives: stays locked.
        straggler = _as_uid(procs, start + 1, gid, "straggler")
        assert pool.release(lease) == 0
        assert pool.quarantined() == [start + 1]
        assert pool.try_acquire() is None
        leftover.kill()
        leftover.wait(10)
        got = pool.try_acquire()
        assert got is not None
        assert got.uid == start
        straggler.kill()
        straggler.wait(10)
        nxt = pool.try_acquire()  # the quarantine drains once nothing of it remains
        assert nxt is not None
        assert nxt.uid == start + 1
        assert pool.quarantined() == []
    finally:
        pool.close()


@pytest.mark.timeout(110)
@pytest.mark.parametrize("tier", ["T2", "T1"])
async def test_fork_bomb_does_not_starve_other_calls_or_workers(
        stacks: Callable[..., Stack], workspace: Path, tier: str) -> None:
    a = stacks(tier=tier)
    b = stacks(tier=tier)
    bomb_id = f"bomb-{uuid.uuid4().hex[:8]}"
    async with BrokerClient(a.frontend, heartbeat_interval_s=HB_S) as ca, \
            BrokerClient(b.frontend, heartbeat_interval_s=HB_S) as cb:
        # The bomb runs until it is cancelled (its wall limit is far away), so
        # the test takes as long as the other calls need, not a fixed wall time.
        bomb = ca.start("tool", request_body(
            "shell", {"command": "touch bomb-started; bomb() { bomb | bomb & }; bomb; "
                                 "sleep 60"},
            workspace, {"limits": {"processes": 64, "wall_s": 90}}, bomb_id), budget_s=100)
        try:
            await asyncio.to_thread(
                lambda: wait_until(lambda: len(call_processes(a.uids, bomb_id)) >= 48,
                                   timeout_s=20.0, interval_s=0.1,
                                   what="the fork bomb to reach its process limit"))
            # Started during the bomb, on the bomb's worker and on another one;
            # each forks 30 times, under the same process limit as the bomb (with
            # a shared uid, bwrap itself failed: "Creating new namespace failed").
            work = "for i in $(seq 30); do /bin/true; done; id -u; echo fine"
            same_limit = {"limits": {"processes": 64}}
            same, other = await asyncio.gather(
                shell(ca, work, workspace, same_limit, timeout_s=45),
                shell(cb, work, workspace, same_limit, timeout_s=45))
            running = call_processes(a.uids, bomb_id)
            # Still running, and held at its process limit as the kernel counts it.
            assert 32 <= len(running) <= 64, len(running)
            bomb_uids = set()  # as the kernel shows them (a fork may end meanwhile)
            for proc in running:
                with contextlib.suppress(psutil.NoSuchProcess):
                    bomb_uids.add(proc.uids().real)
        finally:
            await bomb.cancel()
        with pytest.raises(RequestFailed) as failed:
            await bomb.result()
        assert failed.value.kind == FailureKind.CANCELLED
        # Cancelled mid-bomb: its whole tree goes, every fork of it included.
        await no_call_processes(a.uids, bomb_id, timeout_s=15.0)
    for r in (same, other):
        assert r.result["outcome"] == "ok", r.result["output"]
        assert "fine" in r.result["output"]
        assert r.result["output"].split()[0] == str(r.result["isolation"]["uid"])
        assert r.result["isolation"]["uid"] not in bomb_uids
    assert host_read(workspace / "bomb-started") == ""


@pytest.mark.parametrize("tier", ["T2", "T1"])
async def test_files_are_shared_across_call_uids_and_the_owner(
        stacks: Callable[..., Stack], workspace: Path, tier: str) -> None:
    os.chown(workspace, 4242, 4242)  # a user's workspace, not root's
    st = stacks(tier=tier)
    async with BrokerClient(st.frontend, heartbeat_interval_s=HB_S) as client:
        a = await shell(client, "mkdir -p d/sub && echo a > d/f && echo top > g && "
                        "echo x > d/sub/h", workspace)
        b = await shell(client, "echo b >> d/f && cat d/f && rm g && echo y >> d/sub/h && "
                        "mkdir d/e && echo e > d/e/x", workspace)
        w = await call_tool(client, "write_file", {"path": "d/by_tool", "content": "t\n"},
                            workspace)
        c = await shell(client, "echo c >> d/by_tool && echo z >> d/e/x && cat d/by_tool",
                        workspace)
        r = await call_tool(client, "edit_file", {"path": "d/f", "old": "a\n", "new": "A\n"},
                            workspace)
    uids = {x.result["isolation"]["uid"] for x in (a, b, c)}
    assert len(uids) == 3, uids  # three calls, three uids
    assert a.result["outcome"] == "ok", a.result["output"]
    assert b.result["outcome"] == "ok", b.result["output"]
    assert b.result["output"].split() == ["a", "b"]
    assert not (workspace / "g").exists()
    assert w.result["outcome"] == "ok"
    assert c.result["outcome"] == "ok", c.result["output"]
    assert r.result["outcome"] == "ok", r.result["output"]
    # What the calls created belongs to the workspace's owner once each call ends.
    assert (os.stat(workspace / "d" / "f").st_uid, os.stat(workspace / "d" / "f").st_gid) \
        == (4242, 4242)
    # The workspace owner (uid 4242, not root) reads and writes all of it.
    owner = await asyncio.to_thread(
        subprocess.run,
        ["setpriv", "--reuid=4242", "--regid=4242", "--clear-groups", "--", "/bin/sh", "-c",
         "cat d/f d/sub/h d/e/x d/by_tool && echo o >> d/f && echo o >> d/e/x && "
         "mkdir d/owner && echo o > d/owner/o"],
        cwd=workspace, capture_output=True, text=True, timeout=30, check=False)
    assert owner.returncode == 0, owner.stderr
    assert owner.stdout.split() == ["A", "b", "x", "y", "e", "z", "t", "c"]


@pytest.mark.timeout(90)
async def test_two_workers_never_hold_the_same_uid(stacks: Callable[..., Stack],
                                                   workspace: Path, tmp_path: Path) -> None:
    start = _narrow_range()
    flags = ("--sandbox-uid-range", f"{start}:4", "--sandbox-uid-lock-dir",
             str(tmp_path / "locks"))
    a = stacks(*flags)
    b = stacks(*flags)
    (workspace / "ids").mkdir()
    # Each call records its uid, then waits until all four have: they overlap
    # by construction, so four distinct uids means no uid was held twice.
    cmd = ("id -u > ids/$CORRAL_CALL_ID; n=0; "
           "while [ $(ls ids | wc -l) -lt 4 ] && [ $n -lt 400 ]; do sleep 0.05; n=$((n+1)); "
           "done; ls ids | wc -l")
    async with BrokerClient(a.frontend, heartbeat_interval_s=HB_S) as ca, \
            BrokerClient(b.frontend, heartbeat_interval_s=HB_S) as cb:
        results = await asyncio.gather(*(shell(c, cmd, workspace, timeout_s=60)
                                         for c in (ca, ca, cb, cb)))
        # A fifth call waits for a free uid and then runs.
        fifth = await shell(cb, "id -u", workspace, timeout_s=30)
    uids = [r.result["isolation"]["uid"] for r in results]
    for r in results:
        assert r.result["outcome"] == "ok", r.result["output"]
        assert r.result["output"].strip() == "4"
    assert sorted(uids) == list(range(start, start + 4))
    recorded = sorted(int(p.read_text()) for p in (workspace / "ids").iterdir())
    assert recorded == sorted(uids)  # the record says the uid the command ran as
    assert fifth.result["outcome"] == "ok"
    assert int(fifth.result["output"].strip()) in range(start, start + 4)


@pytest.mark.timeout(90)
async def test_worker_never_runs_a_call_as_a_uid_with_a_leftover(
        stacks: Callable[..., Stack], procs: Procs, workspace: Path, tmp_path: Path,
        gid: int) -> None:
    start = _narrow_range()
    leftover = _as_uid(procs, start, gid, "leftover-of-a-killed-call")
    st = stacks("--sandbox-uid-range", f"{start}:2", "--sandbox-uid-lock-dir",
                str(tmp_path / "locks"))
    async with BrokerClient(st.frontend, heartbeat_interval_s=HB_S) as client:
        # Two at once: the second waits for the one usable uid.
        both = await asyncio.gather(shell(client, "sleep 0.5; id -u", workspace),
                                    shell(client, "sleep 0.5; id -u", workspace))
        later = await shell(client, "id -u", workspace)
        assert leftover.is_running()
        leftover.kill()
        leftover.wait(10)
        # Once the leftover is gone, its uid is usable again.
        after = await asyncio.gather(shell(client, "sleep 0.5; id -u", workspace),
                                     shell(client, "sleep 0.5; id -u", workspace))
    for r in (*both, later):
        assert r.result["outcome"] == "ok", r.result["output"]
        assert r.result["output"].strip() == str(start + 1)
    assert sorted(int(r.result["output"]) for r in after) == [start, start + 1]


@pytest.mark.parametrize(("uid_range", "expected"), [
    ("1:100000", "belongs to a user"),
    ("5", "START:COUNT"),
])
def test_worker_refuses_a_bad_uid_range(procs: Procs, tmp_path: Path, uid_range: str,
                                        expected: str) -> None:
    worker = procs.python("sandbox_worker", "--broker", f"ipc://{tmp_path}/b", "--services",
                          "tool", "--sandbox-uid-range", uid_range, "--sandbox-uid-lock-dir",
                          str(tmp_path / "locks"), name="worker")
    assert worker.wait(timeout=60) != 0
    log = procs.log(worker)
    assert expected in log
    assert "Traceback" not in log
