"""The worker's image pieces alone (no process): where the workspace goes, which
of an image's variables a call gets, how file-tool paths map onto the shell's
view, and that an image chain's shape leaves out per-call values and the
probe's additions (so one probe stands for every call over that image); and
that the layers a dead worker left mounted (a call's or an MCP server's) are
swept by the next worker (one real child process mounts and dies)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sandbox_worker.api import ToolLimits
from sandbox_worker.sandbox.errors import OutsideWorkspace
from sandbox_worker.sandbox.images import (
    DEFAULT_WORKDIR,
    ImageRoot,
    clean_workdir,
    image_env,
    plain_path,
)
from sandbox_worker.sandbox.limits import DEFAULT_LIMITS
from sandbox_worker.sandbox.overlay import Layer, sweep
from sandbox_worker.sandbox.profile import PROBE_USR, Profile
from sandbox_worker.sandbox.user import SandboxUser
from sandbox_worker.tools.service import IN_IMAGE, image_view


@pytest.mark.parametrize(("given", "used"), [
    ("/app", "/app"), ("/srv/app/", "/srv/app"), ("/a/../b", "/b"), ("", DEFAULT_WORKDIR),
    ("relative", DEFAULT_WORKDIR), ("/", DEFAULT_WORKDIR), ("/proc/x", DEFAULT_WORKDIR),
    ("/tmp", DEFAULT_WORKDIR), ("/dev/shm", DEFAULT_WORKDIR), ("/run/corral", DEFAULT_WORKDIR),
    (None, DEFAULT_WORKDIR), ("/" + "a" * 2000, DEFAULT_WORKDIR)])
def test_the_workspace_goes_to_a_clean_working_dir(given: object, used: str) -> None:
    assert clean_workdir(given) == used


def test_an_image_cannot_replace_the_chains_own_variables() -> None:
    env = image_env({"Env": ["PATH=/opt/bin:/bin", "CORRAL_CALL_ID=forged", "A=1=2",
                             "GIT_CONFIG_COUNT=9", "TMPDIR=/x", "NOEQUALS", 7, "=empty"]})
    assert env == {"PATH": "/opt/bin:/bin", "A": "1=2"}


def test_mount_points_through_symlinks_are_seen(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "file").write_text("")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert plain_path(fd, "/real/new/deeper")
        assert plain_path(fd, "/missing")
        assert not plain_path(fd, "/link/x")
        assert not plain_path(fd, "/file/x")
    finally:
        os.close(fd)


def _root(fd: int = -1) -> ImageRoot:
    return ImageRoot(digest="sha256:" + "a" * 64, rootfs_sha256="sha256:" + "b" * 64,
                     rootfs="/store/rootfs", identity="1:2", fd=fd, workdir="/app", env={},
                     user="", home="")


def test_file_tool_paths_follow_the_shells_view() -> None:
    root = _root()
    assert image_view({"path": "/app/src/x.py"}, root, "read_file") == {"path": "src/x.py"}
    assert image_view({"path": "/app"}, root, "list_dir") == {"path": "."}
    assert image_view({"path": "src/x.py"}, root, "write_file") == {"path": "src/x.py"}
    assert image_view({"path": "/etc/os-release"}, root, "read_file") == {
        "path": "etc/os-release", IN_IMAGE: True}
    assert image_view({"path": "/application"}, root, "read_file")[IN_IMAGE] is True
    with pytest.raises(OutsideWorkspace):
        image_view({"path": "/etc/passwd", "content": ""}, root, "write_file")
    # A model cannot ask for the image root itself.
    assert image_view({"path": "x", IN_IMAGE: True}, root, "read_file") == {"path": "x"}


def test_an_image_chains_shape_leaves_out_per_call_values_and_the_probe(tmp_path: Path) -> None:
    profile = Profile("T2", SandboxUser("corral-sandbox", 999, 995), None, None)
    limits = ToolLimits(**DEFAULT_LIMITS)  # type: ignore[typeddict-item]
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        chains = [profile.build(["true"], str(tmp_path), limits, network=False, uid=uid,
                                call_id=cid, image=_root(fd), probe=probe, gid=3000,
                                layer=Layer(f"/run/corral/overlay/1/{cid}"))
                  for uid, cid, probe in ((200001, "c1", False), (200002, "c2", False),
                                          (200003, "probe", True))]
        for chain in chains:
            for passed in chain.pass_fds:
                os.close(passed)
    finally:
        os.close(fd)
    assert chains[0].shape == chains[1].shape == chains[2].shape
    assert PROBE_USR in chains[2].argv
    assert PROBE_USR not in chains[0].argv
    argv = chains[0].argv
    assert argv.index("setpriv") < argv.index("bwrap")
    assert "/usr" not in argv  # nothing of the host is bound
    assert argv[argv.index("--bind") + 1:argv.index("--bind") + 3] == [
        "/run/corral/overlay/1/c1/m", "/"]
    assert "--remount-ro" in argv
    assert argv[argv.index("--remount-ro") + 1] == "/dev"


def _mount_points() -> set[str]:
    with open("/proc/self/mountinfo") as f:
        return {line.split()[4] for line in f}


@pytest.mark.timeout(60)
def test_a_dead_workers_layers_are_swept_at_the_next_start(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a layer needs root, as the worker has")
    (tmp_path / "lower").mkdir()
    dies = ("import os, sys\nfrom sandbox_worker.sandbox.overlay import mount_layer\n"
            "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
            "print(mount_layer(fd, 1 << 20, ['/tmp'], '', 0, 0).root, flush=True)\n"
            "os._exit(0)  # a worker gone without detaching its layer\n")
    root = subprocess.run([sys.executable, "-c", dies, str(tmp_path / "lower")],
                          capture_output=True, text=True, timeout=50, check=True).stdout.strip()
    assert root in _mount_points()
    assert sweep() >= 1
    assert root not in _mount_points()
    assert not Path(root).parent.exists()


def _section(argv: list[str], first: str, end: str, inside: str,
             fds: list[int]) -> list[str]:
    """argv from ``first`` up to (not including) ``end``, the workspace's place
    inside and the chain's fd numbers masked."""
    part = argv[argv.index(first):argv.index(end)]
    masked = {str(fd): f"<fd{i}>" for i, fd in enumerate(fds)}
    return [masked.get(a, a.replace(inside, "<inside>") if inside else a) for a in part]


@pytest.mark.parametrize("read_only", [False, True])
@pytest.mark.parametrize("network", [False, True])
def test_host_and_image_chains_give_a_call_the_same_namespaces_and_mounts(
        tmp_path: Path, read_only: bool, network: bool) -> None:
    """The bwrap namespaces, /dev, the private /tmp and /dev/shm, the workspace
    bind and the read-only .git binds are the same lines in both chains
    (profile.bwrap_start, profile.call_mounts): a fix to one is a fix to both."""
    profile = Profile("T2", SandboxUser("corral-sandbox", 999, 995), None, None)
    limits = ToolLimits(**DEFAULT_LIMITS)  # type: ignore[typeddict-item]
    (tmp_path / ".git").mkdir()
    (tmp_path / "sub" / ".git").mkdir(parents=True)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    gits = [os.open(tmp_path / rel, os.O_PATH) for rel in (".git", "sub/.git")]
    try:
        common: dict[str, Any] = {
            "network": network, "uid": 200001, "call_id": "c1", "gid": 3000,
            "workspace_fd": fd, "read_only": read_only,
            "ro_fds": ((gits[0], ".git"), (gits[1], "sub/.git"))}
        host = profile.build(["true"], str(tmp_path), limits, **common)
        image = profile.build(["true"], str(tmp_path), limits, image=_root(fd),
                              layer=Layer("/run/corral/overlay/1/c1"), **common)
        for chain in (host, image):
            for passed in chain.pass_fds:
                os.close(passed)
    finally:
        for opened in (fd, *gits):
            os.close(opened)
    host_mounts = _section(host.argv, "--dev", "--remount-ro", "/workspace", host.pass_fds)
    image_mounts = _section(image.argv, "--dev", "--remount-ro", "/app", image.pass_fds)
    assert host_mounts == image_mounts
    assert ("--ro-bind-fd" if read_only else "--bind-fd") in host_mounts
    assert host_mounts.count("--ro-bind-fd") == 2 + read_only  # the two .git entries
    assert "<inside>/sub/.git" in host_mounts
    assert _section(host.argv, "bwrap", "--setenv", "", []) == \
        _section(image.argv, "bwrap", "--setenv", "", [])
    assert ("--share-net" in host.argv) is network
