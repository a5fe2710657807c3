"""Filesystem escape probes through the real broker, worker and sandbox.

Each test asserts on the tool result AND on the host's state afterwards.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from broker.client import BrokerClient
from broker.protocol import unpack
from tests.sandbox.conftest import (
    Stack,
    call_tool,
    host_exists,
    host_list,
    host_read,
    shell,
)

pytestmark = pytest.mark.sandbox


async def test_write_to_etc_fails(client: BrokerClient, workspace: Path) -> None:
    name = f"/etc/corral-probe-{uuid.uuid4().hex}"
    res = await shell(client, f"echo pwned > {name}", workspace)
    assert res.result["is_error"]
    assert res.result["exit_code"] != 0
    assert not host_exists(name)


async def test_write_to_root_home_fails(client: BrokerClient, workspace: Path) -> None:
    name = f"/root/corral-probe-{uuid.uuid4().hex}"
    res = await shell(client, f"echo pwned > {name}; ls /root", workspace)
    assert res.result["is_error"]
    assert not host_exists(name)


@pytest.mark.parametrize("base", ["/var/tmp", "/dev/shm"])
async def test_write_to_world_writable_dir_outside_fails(client: BrokerClient, workspace: Path,
                                                         base: str) -> None:
    outside = Path(base) / f"corral-ww-{uuid.uuid4().hex}"
    outside.mkdir()
    outside.chmod(0o1777)
    try:
        res = await shell(client, f"echo pwned > {outside}/f", workspace)
        assert res.result["is_error"]
        assert host_list(outside) == []
    finally:
        for f in outside.iterdir():
            f.unlink()
        outside.rmdir()


async def test_read_shadow_and_root_fails(client: BrokerClient, workspace: Path) -> None:
    res = await shell(client, "cat /etc/shadow; ls -la /root", workspace)
    assert res.result["is_error"]
    shadow_root = host_read("/etc/shadow").splitlines()[0]
    assert shadow_root not in res.result["output"]
    assert "No such file" in res.result["output"] or "Permission denied" in res.result["output"]
    for name in host_list("/root")[:20]:
        if len(name) > 6:  # distinctive names only; "." or "bin" could appear anywhere
            assert name not in res.result["output"]


async def test_write_through_symlink_fails(client: BrokerClient, workspace: Path,
                                           host_dir: Path) -> None:
    target = host_dir / "target"
    target.write_text("original\n")
    target.chmod(0o666)  # only the sandbox, not file permissions, may stop this write
    (workspace / "link").symlink_to(target)
    res = await shell(client, "echo pwned > link", workspace)
    assert res.result["is_error"]
    for tool, args in (("write_file", {"path": "link", "content": "pwned"}),
                       ("edit_file", {"path": "link", "old": "original", "new": "pwned"})):
        r = await call_tool(client, tool, args, workspace)
        assert r.result["is_error"]
        assert r.result["error_kind"] == "outside_workspace"
    assert host_read(target) == "original\n"


async def test_write_through_hardlink_fails(client: BrokerClient, workspace: Path,
                                            host_dir: Path) -> None:
    target = host_dir / "target"
    target.write_text("original\n")
    target.chmod(0o644)
    os.link(target, workspace / "hl")
    res = await shell(client, "echo pwned >> hl", workspace)
    assert res.result["is_error"]
    r = await call_tool(client, "write_file", {"path": "hl", "content": "pwned"}, workspace)
    # Refused either by the link check or, before it, by the file's permissions.
    assert r.result["is_error"]
    assert r.result["error_kind"] in ("hardlinked", "permission_denied")
    r = await call_tool(client, "read_file", {"path": "hl"}, workspace)
    assert r.result["is_error"]
    assert r.result["error_kind"] == "hardlinked"
    assert host_read(target) == "original\n"
    # Nor can the sandbox make such a link itself.
    res = await shell(client, f"ln {target} mine; ln /etc/passwd mine2", workspace)
    assert res.result["is_error"]
    assert not host_exists(workspace / "mine")
    assert not host_exists(workspace / "mine2")


@pytest.mark.parametrize("path", ["../escape", "/etc/passwd", "sub/../../escape",
                                  "dirlink/passwd", "link"])
async def test_file_tools_refuse_paths_outside(client: BrokerClient, workspace: Path,
                                               host_dir: Path, path: str) -> None:
    secret = host_dir / "passwd"
    secret.write_text("SECRET-LINE\n")
    (workspace / "sub").mkdir()
    (workspace / "dirlink").symlink_to(host_dir)
    (workspace / "link").symlink_to(secret)
    before = host_list(host_dir)
    for tool, args in (("read_file", {"path": path}),
                       ("write_file", {"path": path, "content": "pwned"}),
                       ("edit_file", {"path": path, "old": "SECRET", "new": "pwned"}),
                       ("list_dir", {"path": path})):
        r = await call_tool(client, tool, args, workspace)
        assert r.result["is_error"], (tool, path, r.result["output"])
        assert r.result["error_kind"] == "outside_workspace", (tool, path, r.result)
        assert "SECRET" not in r.result["output"]
        assert "Traceback" not in r.result["output"]
    assert host_read(secret) == "SECRET-LINE\n"
    assert host_list(host_dir) == before
    assert not host_read("/etc/passwd").startswith("pwned")


@pytest.mark.timeout(60)
async def test_racing_symlink_flip_leaks_nothing(stack: Stack, client: BrokerClient,
                                                 workspace: Path, host_dir: Path) -> None:
    secret = host_dir / "secret"
    marker = f"SECRET-{uuid.uuid4().hex}"
    secret.write_text(marker + "\n")
    secret.chmod(0o644)  # readable by the sandbox uid: only confinement protects it
    flipper = (
        "end=$((SECONDS+6)); while [ $SECONDS -lt $end ]; do "
        "echo benign > f.tmp; mv -f f.tmp entry; "
        f"ln -sf {secret} l.tmp; mv -Tf l.tmp entry; done"
    )
    (workspace / "entry").write_text("benign\n")
    flip = client.start("tool", _body(flipper, workspace), budget_s=30)
    outcomes = {"benign": 0, "refused": 0, "other": 0}
    leaks = 0
    t_end = time.monotonic() + 2.0
    while time.monotonic() < t_end:
        r = await call_tool(client, "read_file", {"path": "entry"}, workspace)
        out = r.result["output"]
        if marker in out:
            leaks += 1
        elif not r.result["is_error"] and out.startswith("benign"):
            outcomes["benign"] += 1
        elif r.result.get("error_kind") == "outside_workspace":
            outcomes["refused"] += 1
        else:
            outcomes["other"] += 1
    flip_state = "running" if not flip.done else repr(await _outcome(flip))
    await flip.cancel()
    assert leaks == 0, outcomes
    # The race really ran: both sides of the flip were observed.
    assert outcomes["benign"] > 0, (outcomes, flip_state)
    assert outcomes["refused"] > 0, (outcomes, flip_state)
    assert host_read(secret) == marker + "\n"


async def _outcome(call: Any) -> Any:
    try:
        return unpack(await call.result())
    except Exception as exc:
        return exc


def _body(command: str, workspace: Path) -> bytes:
    from tests.sandbox.conftest import request_body

    return request_body("shell", {"command": command}, workspace)


async def test_tmp_is_private_and_bounded(client: BrokerClient, workspace: Path) -> None:
    name = f"corral-tmp-{uuid.uuid4().hex}"
    res = await shell(client, f"echo x > /tmp/{name}; head -c 2G /dev/zero > /tmp/{name}.fill",
                      workspace, {"limits": {"tmpfs_bytes": 16 * 1024 * 1024}})
    assert not host_exists(f"/tmp/{name}")
    assert not host_exists(f"/tmp/{name}.fill")
    if res.result["isolation"]["tier"] in ("T2", "T2-"):
        # A private tmpfs of the requested size: the fill stops at 16 MiB.
        assert "No space left" in res.result["output"]
    else:
        assert "Permission denied" in res.result["output"]


async def test_only_workspace_and_sized_tmpfs_are_writable(client: BrokerClient,
                                                           workspace: Path) -> None:
    cmd = ("for f in /probe /dev/probe /usr/probe /etc/probe; do "
           "echo x > $f 2>/dev/null && echo WROTE:$f; done; "
           "head -c 2G /dev/zero > /dev/shm/fill 2>/dev/null; ls -s /dev/shm/fill; "
           "echo ok > in-workspace")
    res = await shell(client, cmd, workspace, {"limits": {"tmpfs_bytes": 16 * 1024 * 1024}})
    out = res.result["output"]
    assert "WROTE" not in out
    assert host_read(workspace / "in-workspace") == "ok\n"
    if res.result["isolation"]["tier"] in ("T2", "T2-"):
        assert int(out.split()[0]) <= 16 * 1024  # ls -s: KiB used, at most the tmpfs size
    assert not host_exists("/probe")
    assert not host_exists("/usr/probe")
