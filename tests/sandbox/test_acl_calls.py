"""The grant lives as long as the calls of a workspace, through the real broker,
worker and sandbox (T2 and forced T1), checked from the host as the owner and
as another local user would: after a hostile call, a cancelled one, a timed-out
one, overlapping calls, and a worker SIGKILLed mid-call (the next worker's
start-up revokes what it left).
"""

from __future__ import annotations

import asyncio
import grp
import os
import stat
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.client import BrokerClient
from broker.errors import RequestFailed
from broker.protocol import unpack
from sandbox_worker.sandbox.acl import ACL_GROUP, XATTR_ACCESS, XATTR_DEFAULT, decode_acl
from tests.helpers import Procs, eventually, searchable_dir
from tests.sandbox.conftest import (
    HB_S,
    Stack,
    request_body,
    shell,
    start_or_skip,
    start_stack,
)

pytestmark = pytest.mark.sandbox

OWNER = 4242
STRANGER = 4243  # another local user of the host
CORRAL_GIDS = range(200_000, 200_000 + 65_536)  # the default workspace-gid range
SANDBOX_GID = grp.getgrnam("corral-sandbox").gr_gid  # the old shared sandbox group


@pytest.fixture
def user_ws() -> Iterator[Path]:
    with searchable_dir("corral-aclcall-", "/tmp") as path:
        (path / "notes.txt").write_text("the user's\n")
        (path / "private.txt").write_text("the user's secret\n")
        (path / "private.txt").chmod(0o600)
        for p in (path, path / "notes.txt", path / "private.txt"):
            os.chown(p, OWNER, OWNER)
        yield path


def leftovers(root: Path, tool_uids: range, file_uid: int) -> list[str]:
    """What the host shows that Corral left: an ACL entry of a Corral gid (the
    workspace range, the sandbox group), an entry owned by a tool uid, setid
    bits or o+w."""
    bad = []
    for dirpath, dirs, files in os.walk(root):
        for name in ["", *dirs, *files]:
            p = Path(dirpath) / name if name else Path(dirpath)
            st = p.lstat()
            if st.st_uid in tool_uids or st.st_uid == file_uid:
                bad.append(f"{p}: owned by {st.st_uid}")
            if stat.S_ISLNK(st.st_mode):
                continue
            if st.st_mode & (stat.S_ISUID | stat.S_ISGID | stat.S_IWOTH) and not stat.S_ISDIR(
                    st.st_mode):
                bad.append(f"{p}: mode {stat.filemode(st.st_mode)}")
            for attr in (XATTR_ACCESS, XATTR_DEFAULT):
                try:
                    acl = decode_acl(os.getxattr(p, attr))
                except OSError:
                    continue
                ours = [i for t, i in acl
                        if t == ACL_GROUP and (i in CORRAL_GIDS or i == SANDBOX_GID)]
                if ours:
                    bad.append(f"{p}: {attr} names Corral gids {ours}")
    return bad


def as_user(uid: int, script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                           "--", "/bin/sh", "-c", script],
                          capture_output=True, text=True, timeout=30, check=False)


HOSTILE = (
    "mkdir -p d/e && echo x > d/e/f && mkfifo d/p && ln d/e/f d/hl && ln -s /etc d/sl && "
    "echo s > mine && chmod 600 mine && chmod 777 d && chmod 666 d/e/f && "
    "cp /bin/true d/t && chmod 6755 d/t 2>/dev/null; "
    "python3 -c \"import os, struct; os.setxattr('d/e/f', 'system.posix_acl_access', "
    "struct.pack('<I', 2) + b''.join(struct.pack('<HHI', t, p, i) for t, p, i in "
    "[(1, 6, 2**32-1), (2, 7, 4243), (4, 6, 2**32-1), (16, 7, 2**32-1), (32, 6, 2**32-1)]))\"; "
    # A straggler that keeps creating files once the call has returned.
    "(setsid sh -c 'while :; do : > late.$(date +%N) 2>/dev/null; done' >/dev/null 2>&1 &); "
    "echo done")


async def test_a_hostile_call_leaves_the_owner_everything_and_nobody_else_anything(
        stack: Stack, client: BrokerClient, user_ws: Path) -> None:
    r = await shell(client, HOSTILE, user_ws)
    assert "done" in r.result["output"], r.result["output"]
    assert leftovers(user_ws, stack.uids, stack.uid) == []
    assert (user_ws / "d" / "e" / "f").exists()
    # The owner manages every file the call created (chmod, delete) ...
    owner = as_user(OWNER, f"cd {user_ws} && chmod -R u+rwX . && chmod 700 d && "
                    "rm -rf d mine late.* && ls")
    assert owner.returncode == 0, owner.stderr
    assert owner.stdout.split() == ["notes.txt", "private.txt"]
    # ... and another local user gets nothing the user did not give.
    stranger = as_user(STRANGER, f"cd {user_ws}; cat private.txt; echo x > notes.txt; "
                       "touch new; rm -f notes.txt; ls")
    assert "secret" not in stranger.stdout
    assert sorted(os.listdir(user_ws)) == ["notes.txt", "private.txt"]
    assert (user_ws / "notes.txt").read_text() == "the user's\n"
    # The next call works: the grant is made again for it.
    again = await shell(client, "cat notes.txt && echo more >> notes.txt && cat private.txt",
                        user_ws)
    assert again.result["outcome"] == "ok", again.result["output"]
    assert leftovers(user_ws, stack.uids, stack.uid) == []


async def test_a_file_tool_write_leaves_nothing(stack: Stack, client: BrokerClient,
                                                user_ws: Path) -> None:
    from tests.sandbox.conftest import call_tool

    w = await call_tool(client, "write_file", {"path": "x/y/z.txt", "content": "hi"}, user_ws)
    assert w.result["outcome"] == "ok", w.result["output"]
    r = await call_tool(client, "read_file", {"path": "private.txt"}, user_ws)
    assert "secret" in r.result["output"]
    assert leftovers(user_ws, stack.uids, stack.uid) == []
    assert (user_ws / "x" / "y" / "z.txt").stat().st_uid == OWNER


async def _started(client: BrokerClient, command: str, workspace: Path,
                   policy: dict[str, object] | None = None) -> object:
    call = client.start("tool", request_body("shell", {"command": command}, workspace, policy,
                                             call_id=f"acl-{uuid.uuid4().hex[:8]}"),
                        budget_s=120)
    seen = b""
    async with asyncio.timeout(30):
        async for chunk in call:
            seen += unpack(chunk)["data"]
            if b"started" in seen:
                break
    return call


@pytest.mark.parametrize("how", ["cancel", "timeout"])
async def test_a_cancelled_or_timed_out_call_leaves_nothing(
        stack: Stack, client: BrokerClient, user_ws: Path, how: str) -> None:
    command = "trap '' TERM; mkdir -p d && echo x > d/f && echo started && exec sleep 600"
    if how == "cancel":
        call = await _started(client, command, user_ws)
        assert _named_gids(user_ws)  # the grant is in force while it runs
        await call.cancel()  # type: ignore[attr-defined]
    else:
        r = await shell(client, command, user_ws, {"limits": {"wall_s": 2}})
        assert r.result["outcome"] == "timeout", r.result

    async def clean() -> bool:
        return not leftovers(user_ws, stack.uids, stack.uid)

    await eventually(clean, timeout_s=20, what="the release after the call")
    assert (user_ws / "d" / "f").stat().st_uid == OWNER


def _named_gids(path: Path) -> list[int]:
    try:
        acl = decode_acl(os.getxattr(path, XATTR_ACCESS))
    except OSError:
        return []
    return [i for t, i in acl if t == ACL_GROUP and i in CORRAL_GIDS]


@pytest.fixture
def fifo_ws(user_ws: Path) -> Path:
    os.mkfifo(user_ws / "fifo")
    os.chown(user_ws / "fifo", OWNER, OWNER)
    (user_ws / "fifo").chmod(0o666)  # the grant is for directories and regular files
    return user_ws


async def test_overlapping_calls_release_after_the_last(
        stack: Stack, client: BrokerClient, fifo_ws: Path) -> None:
    ws = fifo_ws
    a_task = asyncio.create_task(shell(client, "read line < fifo; echo after > a.txt && "
                                       "echo more >> b.txt && cat notes.txt", ws))

    async def a_waits() -> bool:
        return bool(_named_gids(ws))

    await eventually(a_waits, timeout_s=30, what="A's grant")
    b = await shell(client, "echo b > b.txt", ws)
    assert b.result["outcome"] == "ok", b.result["output"]
    assert _named_gids(ws)  # A still runs: B did not revoke
    assert (ws / "b.txt").stat().st_uid == OWNER  # B's file is the owner's already
    with open(ws / "fifo", "w") as f:  # noqa: ASYNC230 -- a fifo write, returns at once
        f.write("go\n")
    a = await a_task
    assert a.result["outcome"] == "ok", a.result["output"]
    assert "the user's" in a.result["output"]
    assert (ws / "a.txt").read_text() == "after\n"
    assert (ws / "b.txt").read_text() == "b\nmore\n"  # B's file, the owner's, still granted
    (ws / "fifo").unlink()  # the user's own, world-writable
    assert leftovers(ws, stack.uids, stack.uid) == []


# -- a worker SIGKILLed mid-call ------------------------------------------------

@pytest.mark.timeout(180)
@pytest.mark.parametrize("tier", ["T2", "T1"])
async def test_a_worker_killed_mid_call_leaves_nothing_after_the_next_start(
        stack_procs: Procs, tmp_path: Path, user_ws: Path, tier: str) -> None:
    start = 4_300_000 + (os.getpid() % 4096) * 32 + (0 if tier == "T2" else 16)
    extra = ["--sandbox-uid-range", f"{start}:8", "--sandbox-uid-lock-dir",
             str(tmp_path / "uid-locks"), "--workspace-group-dir", str(tmp_path / "groups")]
    first = start_or_skip(stack_procs, tier, *extra)
    uids = range(start, start + 8)
    async with BrokerClient(first.frontend, heartbeat_interval_s=HB_S) as client:
        call = await _started(client, "mkdir -p d/e && echo x > d/e/f && chmod 6755 d/e/f "
                              "2>/dev/null; echo started; exec sleep 600", user_ws)
        first.worker.kill()  # SIGKILL: no release runs
        with pytest.raises(RequestFailed):
            await call.result()  # type: ignore[attr-defined]
    # What the dead call left: its grant and its uid's files.
    assert _named_gids(user_ws)
    assert (user_ws / "d" / "e" / "f").stat().st_uid in uids
    first.worker.wait(timeout=10)
    second = start_stack(stack_procs, tier, *extra)  # its start-up revokes it
    assert second.ready
    assert leftovers(user_ws, uids, first.uid) == []
    assert (user_ws / "d" / "e" / "f").stat().st_uid == OWNER
