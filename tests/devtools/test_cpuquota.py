"""The CPU quota of ``supervisor/devtools/cpuquota.py`` as the kernel enforces it: a real
cgroup, a real busy-looping child; its CPU over wall stays near the quota, the kernel
counts throttled periods, and the group is gone afterwards (also after an exception)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil
import pytest

from supervisor.devtools import cpuquota
from tests.helpers import Procs, wait_until

pytestmark = pytest.mark.timeout(60)

CORES = 0.1
BUSY = "while True: pass"


def _controller() -> cpuquota.Controller:
    try:
        return cpuquota.controller()
    except cpuquota.QuotaUnavailable as e:
        pytest.skip(str(e))


def _cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return float(t.user + t.system)


def _cgroup_line(pid: int, ctl: cpuquota.Controller) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, where = line.split(":", 2)
        if (ctl.v2 and controllers == "") or "cpu" in controllers.split(","):
            return where
    return ""


def test_quota_limits_a_busy_process_and_the_group_is_removed(procs: Procs) -> None:
    ctl = _controller()
    child = procs.spawn([sys.executable, "-c", BUSY], name="busy")
    proc = psutil.Process(child.pid)
    with cpuquota.quota("test-busy", CORES) as group:
        group.add(child.pid)
        assert group.pids() == [child.pid]
        before, cpu0, t0 = group.stat(), _cpu(proc), time.monotonic()
        # 0.2 s of CPU: 2 s of wall under the quota, 0.2 s without one (on a quiet host)
        wait_until(lambda: _cpu(proc) - cpu0 >= 0.2, timeout_s=20.0, interval_s=0.05,
                   what="0.2 s of the child's CPU")
        share = (_cpu(proc) - cpu0) / (time.monotonic() - t0)
        path = group.path
        assert path.exists()
        # unthrottled, a busy loop takes a whole core; a loaded machine may give it less
        assert share <= CORES * 1.5, f"{share:.2f} of a core under a quota of {CORES}"
        # the kernel throttled it (waited for: a starved child may not have reached
        # its quota yet on a host busy with other work)
        wait_until(lambda: group.stat()["nr_throttled"] > before["nr_throttled"],
                   timeout_s=15.0, interval_s=0.05, what="a throttled period in cpu.stat")
        assert group.stat()["throttled_s"] > before["throttled_s"]
        assert group.quota_read() == pytest.approx(CORES)
    assert not path.exists()
    assert child.poll() is None  # moved out, not killed
    assert _cgroup_line(child.pid, ctl) == "/"


def test_the_group_is_removed_when_the_block_raises(procs: Procs) -> None:
    ctl = _controller()
    child = procs.spawn([sys.executable, "-c", BUSY], name="busy")
    paths: list[Path] = []

    def fail_inside() -> None:
        with cpuquota.quota("test-raise", CORES) as g:
            paths.append(g.path)
            g.add(child.pid)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail_inside()
    assert paths
    assert not paths[0].exists()
    assert _cgroup_line(child.pid, ctl) == "/"


def test_a_group_left_by_a_dead_process_is_swept() -> None:
    ctl = _controller()
    dead = psutil.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=10)
    stale = ctl.root / f"{cpuquota.PREFIX}{dead.pid}-left"
    stale.mkdir()
    try:
        with cpuquota.quota("test-sweep", CORES):
            assert not stale.exists()
    finally:
        if stale.exists():
            stale.rmdir()
