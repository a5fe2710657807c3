"""What a T2 call can learn about the host from /proc: exactly the mounts the
chain makes (docs/sandbox.md lists what their lines still show, and why), and
no cgroup path of the worker."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from broker.client import BrokerClient
from tests.sandbox.conftest import Stack, shell

pytestmark = pytest.mark.sandbox

# The chain's own mounts (profile.py); the workspace is added per call.
CHAIN_MOUNTS = {"/", "/usr", "/etc", "/opt", "/proc", "/dev", "/dev/null", "/dev/zero",
                "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty", "/dev/pts", "/tmp",
                "/dev/shm", "/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus"}


def host_mount_points() -> set[str]:
    return {line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()}


async def test_t2_sees_only_its_own_mounts_and_cgroup(stack: Stack, client: BrokerClient,
                                                      workspace: Path) -> None:
    if stack.tier != "T2":
        pytest.skip("T1 has no mount namespace: the host's mount table is visible (documented)")
    res = await shell(client, "cat /proc/self/mountinfo; echo ===; cat /proc/self/cgroup",
                      workspace)
    assert res.result["outcome"] == "ok", res.result["output"]
    mountinfo, _, cgroup = res.result["output"].partition("===\n")
    points = {line.split()[4] for line in mountinfo.splitlines() if line.strip()}
    host_points = host_mount_points()
    extra = points - CHAIN_MOUNTS
    # Whatever else is mounted is the workspace (under its own path or a neutral one).
    assert len(extra) <= 1, extra
    assert not (extra & host_points - {"/"}), "a host mount point other than the workspace"
    for host_only in ("/run", "/sys", "/sys/fs/cgroup", "/var", "/root", "/home", "/boot"):
        assert host_only not in points
    assert "corral/worker-" not in res.result["output"]
    paths = {line.split(":", 2)[2] for line in cgroup.splitlines() if line.count(":") >= 2}
    assert paths == {"/"}  # the cgroup namespace hides the worker's cgroup path


async def test_a_call_does_not_see_the_workers_directory(stack: Stack, client: BrokerClient,
                                                        workspace: Path) -> None:
    """The chain inherited the worker's working directory and the cgroup
    link's shell exported it as PWD: a T2 call read the worker's path (here
    the repository's) in /proc/1/environ. The chain now starts in "/"."""
    worker_dir = os.readlink(f"/proc/{stack.worker.pid}/cwd")
    assert worker_dir != "/"
    res = await shell(client, "cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'; "
                      "readlink /proc/[0-9]*/cwd; env; true", workspace)
    assert res.result["outcome"] == "ok", res.result["output"]
    assert "PWD=" in res.result["output"]
    assert worker_dir not in res.result["output"]
