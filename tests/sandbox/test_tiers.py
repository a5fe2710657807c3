"""Tier selection end to end: forced T2-, opted-in T0, and refusals, each with a
real broker and worker process."""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from broker.client import BrokerClient
from broker.errors import RequestFailed
from tests.helpers import Procs
from tests.sandbox.conftest import (
    HB_S,
    call_processes,
    host_exists,
    no_call_processes,
    request_body,
    shell,
    start_stack,
)

pytestmark = pytest.mark.sandbox


async def test_forced_t2_minus_runs_without_proc(procs: Procs, workspace: Path) -> None:
    st = start_stack(procs, "T2-")
    async with BrokerClient(st.frontend, heartbeat_interval_s=HB_S) as client:
        res = await shell(client, "ls /proc | head -3; echo x > /etc/corral-probe", workspace)
    iso = res.result["isolation"]
    assert iso["tier"] == "T2-"
    assert any("/proc" in d for d in iso["degraded"])
    assert "Read-only file system" in res.result["output"] or \
        "Permission denied" in res.result["output"]
    assert not host_exists("/etc/corral-probe")
    for proc in procs.started:
        if proc.stdout is not None:
            proc.stdout.close()


async def test_t0_needs_opt_in_and_records_it(procs: Procs, workspace: Path) -> None:
    st = start_stack(procs, "T0", "--allow-unsandboxed")
    async with BrokerClient(st.frontend, heartbeat_interval_s=HB_S) as client:
        res = await shell(client, "id -u", workspace)
        refused = await shell(client, "id -u", workspace, {"allow_unsandboxed": False})
    iso = res.result["isolation"]
    assert iso["tier"] == "T0"
    assert iso["unsandboxed_opt_in"] is True
    assert iso["network"] == "host"
    assert iso["seccomp"] is False
    assert int(res.result["output"].strip()) in st.uids  # a per-call uid, never root
    assert iso["uid"] == int(res.result["output"].strip())
    assert refused.result["error_kind"] == "tier_below_minimum"
    for proc in procs.started:
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.parametrize(("extra", "expected"), [
    (["--force-tier", "T0", "--tier-min", "T0"], "--allow-unsandboxed"),
    (["--force-tier", "T1", "--tier-min", "T2"], "below the minimum T2"),
])
def test_worker_refuses_to_start_below_minimum(procs: Procs, extra: list[str],
                                               expected: str) -> None:
    ipc = tempfile.mkdtemp(prefix="csb-", dir="/tmp")
    worker = procs.python("sandbox_worker", "--broker", f"ipc://{ipc}/b", "--services", "tool",
                          *extra, name="worker", stdout=subprocess.PIPE)
    code = worker.wait(timeout=60)
    assert code != 0
    log = procs.log(worker)
    assert expected in log
    assert "Traceback" not in log
    if worker.stdout is not None:
        worker.stdout.close()


@pytest.mark.parametrize("tier", ["T2", "T1"])
async def test_killed_worker_leaves_no_call_behind(procs: Procs, workspace: Path,
                                                   tier: str) -> None:
    st = start_stack(procs, tier)
    call_id = f"orphaned-{tier}-{uuid.uuid4().hex[:8]}"
    async with BrokerClient(st.frontend, heartbeat_interval_s=HB_S) as client:
        call = client.start("tool", request_body(
            "shell", {"command": "(setsid sleep 601 &); echo started; sleep 600"}, workspace,
            call_id=call_id), budget_s=120)
        async with asyncio.timeout(20):
            async for _chunk in call:
                break
        assert call_processes(st.uids, call_id)
        st.worker.kill()  # SIGKILL: no clean-up code of the worker runs
        await no_call_processes(st.uids, call_id, timeout_s=5.0)
        with pytest.raises(RequestFailed):
            await call.result()
    for proc in procs.started:
        if proc.stdout is not None:
            proc.stdout.close()


def test_stale_call_tmp_dirs_of_dead_workers_are_removed(tmp_path: Path) -> None:
    from sandbox_worker.tools.shell import TMP_PREFIX, remove_stale_tmp

    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f"{TMP_PREFIX}{dead.pid}-abc").mkdir()
    (tmp_path / f"{TMP_PREFIX}{dead.pid}-abc" / "f").write_text("x")
    (tmp_path / f"{TMP_PREFIX}{os.getpid()}-live").mkdir()
    (tmp_path / "unrelated").mkdir()
    assert remove_stale_tmp(str(tmp_path)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"{TMP_PREFIX}{os.getpid()}-live", "unrelated"]
