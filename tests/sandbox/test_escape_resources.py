"""Resource probes: fork bomb, memory bomb, CPU spin, output flood, disk fill.
Each ends with a clear result and leaves the machine healthy: no process of
the call left, disk space back."""

from __future__ import annotations

import asyncio
import os
import resource
import shutil
import uuid
from pathlib import Path

import pytest

from broker.client import BrokerClient
from tests.helpers import eventually
from tests.sandbox.conftest import (
    Stack,
    call_tool,
    host_exists,
    needs_system_python,
    no_call_processes,
    shell,
)

pytestmark = pytest.mark.sandbox
MIB = 1024 * 1024


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.mark.timeout(90)
async def test_fork_bomb_is_contained(stack: Stack, client: BrokerClient,
                                      workspace: Path) -> None:
    call_id = _id("forkbomb")
    res = await shell(client, "bomb() { bomb | bomb & }; bomb; sleep 30", workspace,
                      {"limits": {"processes": 64, "wall_s": 4}}, call_id=call_id)
    # Either the wall clock ends it, or the main shell itself cannot fork `sleep`.
    assert res.result["outcome"] in ("timeout", "error")
    assert res.result["is_error"]
    assert "Resource temporarily unavailable" in res.result["output"]  # fork hit the limit
    assert res.result["isolation"]["limits"]["processes"] == 64
    await no_call_processes(stack.uids, call_id, timeout_s=10.0)
    # The uid can still start processes once the call is over (no leaked zombies).
    after = await shell(client, "echo alive", workspace)
    assert after.result["outcome"] == "ok"


async def test_memory_bomb_is_stopped(stack: Stack, client: BrokerClient,
                                      workspace: Path) -> None:
    needs_system_python()
    call_id = _id("membomb")
    res = await shell(client, "python3 -c 'b = bytearray(8 * 1024**3); print(len(b))'",
                      workspace, {"limits": {"address_space_bytes": 512 * MIB}},
                      call_id=call_id)
    assert res.result["is_error"]
    assert "MemoryError" in res.result["output"]
    assert res.result["isolation"]["limits"]["address_space_bytes"] == 512 * MIB
    await no_call_processes(stack.uids, call_id)


async def test_cpu_spin_is_stopped(stack: Stack, client: BrokerClient,
                                   workspace: Path) -> None:
    call_id = _id("cpuspin")
    res = await shell(client, "while :; do :; done", workspace,
                      {"limits": {"cpu_s": 1, "wall_s": 60}}, call_id=call_id)
    assert res.result["is_error"]
    assert res.result["outcome"] == "error"  # stopped by RLIMIT_CPU, not by the wall clock
    assert "SIGXCPU" in res.result["output"] or "SIGKILL" in res.result["output"]
    assert res.result["duration_s"] < 30
    await no_call_processes(stack.uids, call_id)


@pytest.mark.timeout(60)
async def test_output_flood_is_capped_and_killed(stack: Stack, client: BrokerClient,
                                                 workspace: Path) -> None:
    call_id = _id("flood")
    res = await shell(client, "head -c 4G /dev/zero | tr '\\0' x; echo unreachable >&2",
                      workspace, call_id=call_id)
    r = res.result
    assert r["is_error"]
    assert r["error_kind"] == "output_limit"
    assert r["truncated"]
    assert r["stdout_bytes"] == MIB
    assert "truncated at 1048576 bytes" in r["output"]
    assert len(res.streamed("stdout")) == MIB  # what streamed is what was kept
    assert r["duration_s"] < 30
    await no_call_processes(stack.uids, call_id)


async def test_wall_timeout_keeps_partial_output(stack: Stack, client: BrokerClient,
                                                 workspace: Path) -> None:
    call_id = _id("timeout")
    res = await call_timeout(client, workspace, call_id)
    r = res.result
    assert r["outcome"] == "timeout"
    assert r["error_kind"] == "timeout"
    assert "before" in r["output"]
    assert "timed out after 1 s" in r["output"]
    await no_call_processes(stack.uids, call_id)


async def call_timeout(client: BrokerClient, workspace: Path, call_id: str) -> object:
    from tests.sandbox.conftest import call_tool

    return await call_tool(client, "shell", {"command": "echo before; sleep 30",
                                             "timeout_s": 1}, workspace, call_id=call_id)


async def test_disk_fill_stops_at_file_size_limit(stack: Stack, client: BrokerClient,
                                                  workspace: Path) -> None:
    call_id = _id("diskfill")
    free_before = shutil.disk_usage(workspace).free
    res = await shell(client, "head -c 2G /dev/zero > big; echo rc=$?", workspace,
                      {"limits": {"file_size_bytes": 32 * MIB}}, call_id=call_id)
    assert "rc=153" in res.result["output"] or "File too large" in res.result["output"]
    assert (workspace / "big").stat().st_size <= 32 * MIB
    cleanup = await shell(client, "rm -f big", workspace)
    assert cleanup.result["outcome"] == "ok"
    assert not host_exists(workspace / "big")
    # Free space is back (within what other users of this shared disk may do).
    assert shutil.disk_usage(workspace).free > free_before - 64 * MIB
    await no_call_processes(stack.uids, call_id)


async def test_many_directories_do_not_exhaust_the_workers_fds(stack: Stack,
                                                               client: BrokerClient,
                                                               workspace: Path) -> None:
    """A call makes 3,000 subdirectories in one directory (under a second).
    The release after it and the next call's grant walk the tree; they held
    an fd per directory still to visit, so with the worker's RLIMIT_NOFILE at
    1,024 the walks skipped the directories past the limit (the next call
    could not write in them: "Permission denied"; the release left them to
    the tool uid), and any other call of the worker that needed an fd while
    a walk held them all failed ("Too many open files"). The walks now hold
    a bounded number of fds (sandbox/treewalk.py)."""
    pid = stack.worker.pid
    old = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (1024, old[1]))  # the soft limit only
    try:
        made = await shell(client, "mkdir d && cd d && seq 3000 | xargs mkdir && ls | wc -l",
                           workspace)
        assert made.result["outcome"] == "ok", made.result["output"]
        again = await shell(client, "touch d/1/x d/3000/x && echo done", workspace)
        assert again.result["outcome"] == "ok", again.result["output"]
        listed = await call_tool(client, "list_dir", {"path": "d"}, workspace)
        assert listed.result["outcome"] == "ok", listed.result["output"]
        assert listed.result["output"].splitlines()[0] == "1/"
        assert "[... 2000 more entries not shown]" in listed.result["output"]
        # Both releases reached every directory: all given to the workspace's owner.
        owner = os.stat(workspace).st_uid
        for sub in ("1", "1500", "3000", "3000/x"):
            assert os.stat(workspace / "d" / sub).st_uid == owner, sub
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, old)


def _peak_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


async def test_an_edit_is_bounded_before_it_is_made(stack: Stack, client: BrokerClient,
                                                    workspace: Path) -> None:
    """edit_file checked the result's size after building it: a 1 MB file of
    "a", old "a", new 500 characters and count 1,000,000 made the worker build
    500 MB of text and as much UTF-8 (with new 2,000 characters, 2 GB: the
    worker went silent and the broker declared it lost). The size is now
    computed first; the worker's peak RSS does not move."""
    made = await shell(client, "head -c 1000000 /dev/zero | tr '\\0' a > big", workspace)
    assert made.result["outcome"] == "ok", made.result["output"]
    before = _peak_rss_kib(stack.worker.pid)
    r = await call_tool(client, "edit_file", {"path": "big", "old": "a", "new": "b" * 500,
                                              "count": 1_000_000}, workspace)
    assert r.result["error_kind"] == "too_large", r.result["output"]
    assert "500000000 bytes" in r.result["output"]
    grew_mib = (_peak_rss_kib(stack.worker.pid) - before) // 1024
    assert grew_mib < 100, f"the worker's peak RSS grew by {grew_mib} MiB"
    assert os.stat(workspace / "big").st_size == 1_000_000


async def test_deep_nested_repositories_hold_few_worker_fds(stack: Stack, client: BrokerClient,
                                                            workspace: Path) -> None:
    """The directories above a nested .git are bound over themselves for a
    call (each an fd the worker holds while the call runs, and a mount). A
    call that made 64 chains of 40 directories with a .git at each end had
    the next call hold 2,470 fds in the worker. At most MAX_DIR_BINDS (128),
    shallowest first, are bound now."""
    made = await shell(client, "for i in $(seq 64); do p=r$i; for j in $(seq 40); do "
                       "p=$p/d; done; mkdir -p $p/.git; done; echo made", workspace)
    assert made.result["outcome"] == "ok", made.result["output"]
    before = len(os.listdir(f"/proc/{stack.worker.pid}/fd"))
    call = asyncio.ensure_future(shell(
        client, "touch started; while [ ! -e go ]; do sleep 0.02; done; mv r1 r1x; echo done",
        workspace, timeout_s=60))
    try:
        async def running() -> bool:  # the call's command runs: its binds are held
            return (workspace / "started").exists()

        await eventually(running, timeout_s=30, what="the call to start")
        during = len(os.listdir(f"/proc/{stack.worker.pid}/fd"))
    finally:
        (workspace / "go").touch()
        res = await call
    assert res.result["outcome"] == "ok", res.result["output"]
    assert during - before < 600, f"the worker held {during - before} more fds for the call"
    if stack.tier == "T2":  # the shallow directories are still pinned
        assert "Device or resource busy" in res.result["output"], res.result["output"]
