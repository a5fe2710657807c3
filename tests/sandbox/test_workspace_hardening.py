"""Workspace hardening probes, driven as an attacker would, through the real
broker, worker and sandbox (at T2 and at forced T1), with the host's state
checked afterwards: setuid/setgid plants, one group per workspace, ownership
of what tools create, read-only workspaces and modes, ``.git`` kept read-only,
a workspace swapped for a symlink after its session began, and what
``/proc/self/mountinfo`` shows.
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.client import BrokerClient
from sandbox_worker.sandbox.acl import (
    ACL_GROUP,
    ACL_MASK,
    ACL_USER,
    UNDEFINED_ID,
    XATTR_ACCESS,
    decode_acl,
)
from tests.helpers import eventually, searchable_dir
from tests.sandbox.conftest import Stack, call_tool, needs_system_python, shell

pytestmark = pytest.mark.sandbox

OWNER = 4242  # a user's workspace, not root's


@pytest.fixture
def user_ws() -> Iterator[Path]:
    with searchable_dir("corral-uws-", "/tmp") as path:
        os.chown(path, OWNER, OWNER)
        yield path


def _tree(root: Path) -> list[tuple[Path, os.stat_result]]:
    out = []
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            out.append((p, p.lstat()))
    return out


def _setid(root: Path) -> list[str]:
    return [f"{p} {stat.filemode(st.st_mode)}" for p, st in _tree(root)
            if st.st_mode & (stat.S_ISUID | stat.S_ISGID) and not stat.S_ISDIR(st.st_mode)]


PLANTS = ("cp /usr/bin/id suid; chmod 6755 suid; chmod u+s suid; chmod g+s suid; "
          "install -m 4755 /usr/bin/id inst; mkdir sgdir; chmod 2775 sgdir; "
          "cp /usr/bin/id t; chmod 755 t; chmod 4755 t; "
          "python3 -c \"import os; os.close(os.open('created', os.O_CREAT|os.O_WRONLY, 0o6755))\"; "
          "python3 -c \"import os; os.mknod('nod', 0o104755)\"; "
          "stat -c '%a %n' suid inst t created nod sgdir; true")


async def test_no_setuid_or_setgid_file_is_left_on_the_host(
        stack: Stack, client: BrokerClient, user_ws: Path) -> None:
    needs_system_python()
    r = await shell(client, PLANTS, user_ws)
    assert r.result["outcome"] == "ok", r.result["output"]
    # Inside the sandbox every attempt failed (seccomp): nothing carries the bits.
    for line in r.result["output"].splitlines():
        if line[:4].isdigit():
            assert not int(line.split()[0], 8) & 0o6000, line
    assert _setid(user_ws) == []
    assert not (user_ws / "sgdir").stat().st_mode & stat.S_ISGID


async def test_created_files_end_owned_by_the_workspace_owner(
        stack: Stack, client: BrokerClient, user_ws: Path) -> None:
    r = await shell(client, "mkdir -p a/b && echo x > a/b/f && ln -s f a/b/l && echo y > g "
                    "&& echo s > priv && chmod 600 priv", user_ws)
    assert r.result["outcome"] == "ok", r.result["output"]
    w = await call_tool(client, "write_file", {"path": "d/new.txt", "content": "hi"}, user_ws)
    assert w.result["outcome"] == "ok", w.result["output"]
    owners = {str(p.relative_to(user_ws)): (st.st_uid, st.st_gid) for p, st in _tree(user_ws)}
    assert set(owners.values()) == {(OWNER, OWNER)}, owners
    # No ACL is left on them (the grant is revoked when the call ends), and a
    # file the tool made private keeps its mode.
    for p, st in _tree(user_ws):
        if not stat.S_ISLNK(st.st_mode):
            with pytest.raises(OSError, match="No data available"):
                os.getxattr(p, XATTR_ACCESS)
    assert stat.S_IMODE((user_ws / "priv").stat().st_mode) == 0o600
    # The next call (another uid) still reads and writes them, through its own grant.
    again = await shell(client, "cat a/b/f d/new.txt && echo z >> a/b/f && rm g", user_ws)
    assert again.result["outcome"] == "ok", again.result["output"]


async def test_each_workspace_has_its_own_group(stack: Stack, client: BrokerClient,
                                                user_ws: Path) -> None:
    with searchable_dir("corral-other-", "/tmp") as other:
        secret = other / "secret.txt"
        secret.write_text("other workspace\n")
        secret.chmod(0o640)
        a = await shell(client, "id -g", user_ws)
        b = await shell(client, "id -g", other)
        assert a.result["outcome"] == b.result["outcome"] == "ok"
        gid_a, gid_b = int(a.result["output"].split()[0]), int(b.result["output"].split()[0])
        assert gid_a != gid_b
        assert stack.info["sandbox_gid"] not in (gid_a, gid_b)
        # While a call of B runs, B's grant is in force; at T1 the host
        # filesystem is visible: A's calls still cannot read B.
        b_call = asyncio.create_task(shell(client, "sleep 3", other))
        try:
            async def granted() -> bool:
                return _has_entry(secret, gid_b)

            await eventually(granted, timeout_s=20, what="B's grant")
            assert not _has_entry(secret, gid_a)
            r = await shell(client, f"cat {secret}", user_ws)
            assert "other workspace" not in r.result["output"]
        finally:
            await b_call
        assert not _has_entry(secret, gid_b)


def _has_entry(path: Path, gid: int) -> bool:
    try:
        return (ACL_GROUP, gid) in decode_acl(os.getxattr(path, XATTR_ACCESS))
    except OSError:
        return False


async def test_read_only_workspace_is_not_widened(stack: Stack, client: BrokerClient,
                                                  user_ws: Path) -> None:
    (user_ws / "f.txt").write_text("keep\n")
    (user_ws / "f.txt").chmod(0o444)
    os.chmod(user_ws, 0o555)
    try:
        r = await shell(client, "echo new > n.txt; echo more >> f.txt; cat f.txt", user_ws)
        w = await call_tool(client, "write_file", {"path": "f.txt", "content": "gone"}, user_ws)
        assert w.result["is_error"]
        assert "keep" in r.result["output"]
        assert (user_ws / "f.txt").read_text() == "keep\n"
        assert not (user_ws / "n.txt").exists()
        # Nothing granted is left, and the modes are the user's.
        for path, mode in ((user_ws, 0o555), (user_ws / "f.txt", 0o444)):
            assert stat.S_IMODE(path.stat().st_mode) == mode
            with pytest.raises(OSError, match="No data available"):
                os.getxattr(path, XATTR_ACCESS)
    finally:
        os.chmod(user_ws, 0o755)


async def test_read_only_mode(stack: Stack, client: BrokerClient, user_ws: Path) -> None:
    (user_ws / "f.txt").write_text("keep\n")
    os.chown(user_ws / "f.txt", OWNER, OWNER)
    policy = {"sandbox_mode": "read-only"}
    r = await shell(client, "cat f.txt; echo x > f.txt; touch new", user_ws, policy)
    assert "keep" in r.result["output"]
    assert r.result["isolation"]["sandbox_mode"] == "read-only"
    w = await call_tool(client, "write_file", {"path": "g", "content": "x"}, user_ws, policy)
    assert w.result["error_kind"] == "read_only"
    assert w.result["isolation"]["sandbox_mode"] == "read-only"
    assert (user_ws / "f.txt").read_text() == "keep\n"
    assert sorted(os.listdir(user_ws)) == ["f.txt"]
    bad = await shell(client, "true", user_ws, {"sandbox_mode": "yolo"})
    assert bad.result["error_kind"] == "bad_arguments"


async def test_git_is_read_only_unless_opted_in(stack: Stack, client: BrokerClient,
                                                user_ws: Path) -> None:
    git = user_ws / ".git"
    (git / "hooks").mkdir(parents=True)
    (git / "config").write_text("[core]\n")
    attack = ("printf '\\tfsmonitor = touch /tmp/pwned\\n' >> .git/config; "
              "echo 'touch /tmp/pwned' > .git/hooks/pre-commit; "
              "mv .git/config .git/config.old; rm -rf .git/hooks; true")
    w = await call_tool(client, "write_file", {"path": ".git/hooks/post-checkout",
                                               "content": "#!/bin/sh\n"}, user_ws)
    assert w.result["error_kind"] == "git_protected"
    e = await call_tool(client, "edit_file", {"path": ".git/config", "old": "[core]",
                                              "new": "[core]\n\tfsmonitor = x"}, user_ws)
    assert e.result["error_kind"] == "git_protected"
    r = await shell(client, attack, user_ws)
    if stack.tier == "T2":
        assert r.result["isolation"]["git_writable"] is False
        assert (git / "config").read_text() == "[core]\n"
        assert sorted(os.listdir(git)) == ["config", "hooks"]
        assert os.listdir(git / "hooks") == []
    else:  # Landlock cannot carve .git out of the workspace: recorded, not hidden
        assert r.result["isolation"]["git_writable"] is True
        assert any(".git" in d for d in r.result["isolation"]["degraded"])
    # A nested repository made since the last call is protected at the next
    # call (its grant walks past it), without waiting for a sweep to note it.
    (user_ws / "vendor" / "lib" / ".git").mkdir(parents=True)
    nested = await shell(client, "touch vendor/lib/.git/HEAD", user_ws)
    if stack.tier == "T2":
        assert nested.result["is_error"]
        assert os.listdir(user_ws / "vendor" / "lib" / ".git") == []
    opted = await shell(client, "echo '[user]' >> .git/config", user_ws,
                        {"git_writable": True})
    assert opted.result["outcome"] == "ok", opted.result["output"]
    assert opted.result["isolation"]["git_writable"] is True
    assert "[user]" in (git / "config").read_text()


async def test_nested_git_is_read_only_at_a_workers_first_call(stack: Stack,
                                                               client: BrokerClient,
                                                               user_ws: Path) -> None:
    """A user's workspace holding nested repositories (a vendored one, a
    submodule's ``.git`` file) that this worker never saw: the very first
    call of a hostile model must not plant a hook or rewrite their config
    (the user's next ``git commit`` there would run it). Before the grant's
    walk reported them, only the root's ``.git`` was bound at a worker's first
    call of a workspace, and these writes succeeded."""
    hooks = user_ws / "vendor" / "lib" / ".git" / "hooks"
    hooks.mkdir(parents=True)
    (hooks.parent / "config").write_text("[core]\n")
    sub = user_ws / "deps" / "sub"
    sub.mkdir(parents=True)
    (sub / ".git").write_text("gitdir: ../../.git/modules/sub\n")
    for path, _ in _tree(user_ws):
        os.chown(path, OWNER, OWNER)
    r = await shell(client, "echo 'touch /tmp/pwned' > vendor/lib/.git/hooks/pre-commit; "
                    "echo '[core] hooksPath = /tmp' >> vendor/lib/.git/config; "
                    "echo 'gitdir: /tmp/evil' > deps/sub/.git; true", user_ws)
    if stack.tier != "T2":  # T1 cannot bind .git read-only: recorded as such
        assert r.result["isolation"]["git_writable"] is True
        return
    assert r.result["outcome"] == "ok", r.result["output"]
    assert r.result["output"].count("Read-only file system") == 3, r.result["output"]
    assert os.listdir(hooks) == []
    assert (hooks.parent / "config").read_text() == "[core]\n"
    assert (sub / ".git").read_text() == "gitdir: ../../.git/modules/sub\n"


async def test_a_nested_repository_cannot_be_moved_aside(stack: Stack, client: BrokerClient,
                                                        user_ws: Path) -> None:
    """Its .git read-only is not enough: a call moved the directory holding it
    aside (``mv vendor/lib vendor/lib.orig``), made its own ``vendor/lib``
    with a ``.git`` whose hook it wrote, and the user's next ``git commit``
    in ``vendor/lib`` ran it. Two calls at once also won a race: one flipped
    ``vendor`` for a decoy while the other's bwrap bound the real ``.git``
    over the decoy's (8 of 60 calls wrote into the real one). The
    directories from the workspace down to a nested ``.git`` are now mount
    points in every T2 call, which no call can rename or remove."""
    git = user_ws / "vendor" / "lib" / ".git"
    (git / "hooks").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    for path, _ in _tree(user_ws):
        os.chown(path, OWNER, OWNER)
    attack = ("mv vendor/lib vendor/lib.orig; mv vendor v2; rm -rf vendor; "
              "mv vendor/lib/.git vendor/lib/old; "
              "mkdir -p vendor/lib/.git/hooks && echo 'touch /tmp/pwned' > "
              "vendor/lib/.git/hooks/pre-commit; echo work > vendor/lib/notes; true")
    r = await shell(client, attack, user_ws)
    if stack.tier != "T2":  # T1 cannot bind .git read-only: recorded as such
        assert r.result["isolation"]["git_writable"] is True
        return
    assert r.result["outcome"] == "ok", r.result["output"]
    assert r.result["output"].count("Device or resource busy") >= 3, r.result["output"]
    assert sorted(os.listdir(user_ws)) == ["vendor"]
    assert sorted(os.listdir(user_ws / "vendor")) == ["lib"]
    assert sorted(os.listdir(git)) == ["HEAD", "hooks"]
    assert os.listdir(git / "hooks") == []
    # The rest of the nested repository stays writable.
    assert (user_ws / "vendor" / "lib" / "notes").read_text() == "work\n"


async def test_workspace_swapped_for_a_symlink_is_refused(
        stack: Stack, client: BrokerClient) -> None:
    with searchable_dir("corral-parent-", "/tmp") as parent, \
            searchable_dir("corral-victim-", "/var/tmp") as victim:
        (victim / "secret").write_text("root only\n")
        (victim / "secret").chmod(0o600)
        inner = parent / "sub"
        inner.mkdir()
        session = f"s-{uuid.uuid4().hex[:8]}"
        first = await call_tool(client, "shell", {"command": "echo ok"}, inner,
                                session_id=session)
        assert first.result["outcome"] == "ok", first.result["output"]
        inner.rename(parent / "moved")
        inner.symlink_to(victim)
        for tool, args in (("shell", {"command": "cat secret; echo pwned > p"}),
                           ("read_file", {"path": "secret"}),
                           ("write_file", {"path": "p", "content": "pwned"})):
            r = await call_tool(client, tool, args, inner, session_id=session)
            assert r.result["error_kind"] == "workspace_unusable", r.result
            assert "root only" not in r.result["output"]
        # Nothing was granted, written or mounted there.
        assert sorted(os.listdir(victim)) == ["secret"]
        for path in (victim, victim / "secret"):
            with pytest.raises(OSError, match="No data available"):
                os.getxattr(path, XATTR_ACCESS)
        # A renamed-in directory (same path, other inode) is refused too.
        inner.unlink()
        (parent / "moved").rename(parent / "old")
        inner.mkdir()
        r = await call_tool(client, "shell", {"command": "true"}, inner, session_id=session)
        assert r.result["error_kind"] == "workspace_unusable"
        assert "no longer the directory" in r.result["output"]


async def test_mountinfo_shows_a_neutral_mount_point(stack: Stack, client: BrokerClient,
                                                     user_ws: Path) -> None:
    if stack.tier != "T2":
        pytest.skip("T1 has no mount namespace")
    r = await shell(client, "pwd; grep -c ' /workspace ' /proc/self/mountinfo", user_ws)
    lines = r.result["output"].split()
    assert lines[0] == "/workspace"
    assert lines[1] == "1"


def test_sweep_gives_tool_files_to_the_owner_and_clears_setid(user_ws: Path) -> None:
    """The second layer, alone (the only one at T0): a setuid/setgid file, a
    setgid directory and a symlink left by tool uids."""
    from sandbox_worker.sandbox.ownership import normalise

    tool = range(900_000, 900_010)
    (user_ws / "d").mkdir()
    (user_ws / "d" / "x").write_bytes(b"\x7fELF")
    (user_ws / "d" / "l").symlink_to("/etc/shadow")
    (user_ws / "mine").write_text("the owner's own setgid file\n")
    os.chown(user_ws / "mine", OWNER, OWNER)
    os.chmod(user_ws / "mine", 0o2644)
    for p in (user_ws / "d", user_ws / "d" / "x"):
        os.chown(p, 900_001, 555_555)
    os.chown(user_ws / "d" / "l", 900_002, 555_555, follow_symlinks=False)
    os.chmod(user_ws / "d" / "x", 0o6755)
    os.chmod(user_ws / "d", 0o2775)
    fd = os.open(user_ws, os.O_PATH | os.O_DIRECTORY)
    try:
        report = normalise(fd, lambda uid: uid in tool)
    finally:
        os.close(fd)
    assert report.chowned == 3
    assert _setid(user_ws) == [f"{user_ws / 'mine'} -rw-r-Sr--"]  # not a tool's: untouched
    assert not (user_ws / "d").stat().st_mode & stat.S_ISGID  # its parent is not setgid
    for p in (user_ws / "d", user_ws / "d" / "x", user_ws / "d" / "l"):
        st = p.lstat()
        assert (st.st_uid, st.st_gid) == (OWNER, OWNER)
    assert Path("/etc/shadow").stat().st_uid == 0  # the symlink was not followed


async def test_a_workspace_under_a_0700_parent_works_without_loosening_it(
        stack: Stack, client: BrokerClient) -> None:
    with searchable_dir("corral-private-", "/tmp") as parent:
        os.chmod(parent, 0o700)
        ws = parent / "proj"
        ws.mkdir()
        os.chown(ws, OWNER, OWNER)
        (ws / "notes.txt").write_text("mine\n")
        r = await shell(client, "cat notes.txt && echo out > made.txt && ls", ws)
        assert r.result["outcome"] == "ok", r.result["output"]
        f = await call_tool(client, "read_file", {"path": "made.txt"}, ws)
        assert f.result["output"].startswith("out"), f.result
        assert stat.S_IMODE(os.stat(parent).st_mode) == 0o700
        with pytest.raises(OSError, match="No data available"):
            os.getxattr(parent, XATTR_ACCESS)
        assert os.stat(ws / "made.txt").st_uid == OWNER
        # A host user (another uid, another group) cannot use the way in.
        host_user = await asyncio.to_thread(
            subprocess.run, ["setpriv", "--reuid=4243", "--regid=4243", "--clear-groups",
                             "--", "/bin/sh", "-c",
                             "cat /run/corral/workspaces/*/ws/notes.txt"],
            capture_output=True, text=True, timeout=30, check=False)
        assert "mine" not in host_user.stdout
        assert host_user.returncode != 0
        # Another workspace's calls (another group) cannot use the way in.
        with searchable_dir("corral-other-", "/tmp") as other:
            probe = await shell(client, "ls /run/corral/workspaces/*/ws 2>&1; true", other)
            assert "notes.txt" not in probe.result["output"]


def test_workspace_groups_are_one_per_identity_across_workers(tmp_path: Path) -> None:
    """Two registries on one directory (two workers) racing for 40 workspaces:
    one gid per identity, the same gid for the same identity, none shared."""
    from concurrent.futures import ThreadPoolExecutor

    from sandbox_worker.sandbox.errors import SandboxSetupError
    from sandbox_worker.sandbox.wsgroups import WorkspaceGroups

    d = str(tmp_path / "groups")
    a, b = WorkspaceGroups(910_000, 64, d), WorkspaceGroups(910_000, 64, d)
    a.setup()
    b.setup()
    idents = [(7, 1000 + 64 * i) for i in range(40)]  # all start at the same gid
    with ThreadPoolExecutor(8) as ex:
        got_a = list(ex.map(lambda i: a.gid_for(*i), idents))
        got_b = list(ex.map(lambda i: b.gid_for(*i), reversed(idents)))
    assert got_a == list(reversed(got_b))
    assert len(set(got_a)) == 40
    assert all(910_000 <= g < 910_064 for g in got_a)
    with pytest.raises(SandboxSetupError, match="belongs to a group"):
        WorkspaceGroups(0 + 65534, 2, d).setup()  # nogroup's gid


def test_grant_never_raises_an_existing_mask(user_ws: Path) -> None:
    """A user's file with an extended ACL (user:4243 rw- under mask r--): the grant
    must not raise the mask, which would give 4243 write access."""
    from sandbox_worker.sandbox.acl import (
        ACL_GROUP_OBJ,
        ACL_OTHER,
        ACL_USER_OBJ,
        encode_acl,
    )
    from sandbox_worker.sandbox.workspace import grant_tree

    f = user_ws / "shared.txt"
    f.write_text("x\n")
    os.chown(f, OWNER, OWNER)
    acl = {(ACL_USER_OBJ, UNDEFINED_ID): 6, (ACL_USER, 4243): 6,
           (ACL_GROUP_OBJ, UNDEFINED_ID): 4, (ACL_MASK, UNDEFINED_ID): 4,
           (ACL_OTHER, UNDEFINED_ID): 4}
    os.setxattr(f, XATTR_ACCESS, encode_acl(acl))
    fd = os.open(user_ws, os.O_PATH | os.O_DIRECTORY)
    try:
        grant_tree(fd, 777_001)
    finally:
        os.close(fd)
    after = decode_acl(os.getxattr(f, XATTR_ACCESS))
    assert after[(ACL_MASK, UNDEFINED_ID)] == 4
    assert after[(ACL_USER, 4243)] == 6
    assert after[(ACL_GROUP, 777_001)] == 6


async def test_sweep_finds_new_files_deep_in_old_directories(stack: Stack, client: BrokerClient,
                                                             user_ws: Path) -> None:
    """The sweep examines only directories changed during the call (after a full
    first sweep per workspace and worker): new entries deep in directories
    untouched for years are still found, through their parents' mtimes."""
    deep = user_ws / "a" / "b" / "c"
    deep.mkdir(parents=True)
    await shell(client, "true", user_ws)  # the first, full sweep
    for p in (deep, deep.parent, deep.parent.parent, user_ws):
        os.chown(p, OWNER, OWNER)
        os.utime(p, (1_000_000_000, 1_000_000_000))
    r = await shell(client, "echo new > a/b/c/new.txt && mkdir -p a/b/c/d/e && "
                    "echo x > a/b/c/d/e/f", user_ws)
    assert r.result["outcome"] == "ok", r.result["output"]
    for p in (deep / "new.txt", deep / "d", deep / "d" / "e" / "f"):
        st = p.lstat()
        assert (st.st_uid, st.st_gid) == (OWNER, OWNER), p


def test_aliases_no_call_holds_are_detached_by_a_sweep() -> None:
    """A held alias survives a sweep (a worker starting or stopping); once its
    holder is gone (a SIGKILLed worker's lock dies with it) the next sweep
    detaches it, also when its workspace was deleted meanwhile."""
    from sandbox_worker.sandbox import wsalias

    with searchable_dir("corral-gone-", "/tmp") as parent:
        os.chmod(parent, 0o700)
        ws = parent / "proj"
        ws.mkdir()
        fd = os.open(ws, os.O_PATH | os.O_DIRECTORY)
        try:
            st = os.fstat(fd)
            alias = wsalias.alias_for(fd, 777_123, (st.st_dev, st.st_ino))
        finally:
            os.close(fd)
        try:
            assert wsalias._is_mount(alias.path)
            wsalias.sweep()
            assert wsalias._is_mount(alias.path)  # held: kept
        finally:
            os.close(alias.lock_fd)  # its holder dies without releasing it
    assert wsalias._is_mount(alias.path)  # the workspace is gone, its alias not yet
    wsalias.sweep()
    assert not wsalias._is_mount(alias.path)


async def test_a_walk_cut_at_its_bound_forgets_no_nested_repository(
        user_ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The grant and the release walk a bounded number of entries (200 000
    and 400 000). A call that filled the workspace with entries walked before
    a nested repository made the release's walk stop short of it, and the
    worker replaced what it knew of the workspace's repositories with that
    walk's list: the next calls bound no read-only ``.git`` there. A walk cut
    short now adds to what was known instead. (Bounds of 3 entries stand for
    the real ones; the pins are the worker's own, on a real tree.)"""
    from sandbox_worker.sandbox import ownership, workspace
    from sandbox_worker.sandbox.wsgroups import WorkspaceGroups
    from sandbox_worker.tools.pinning import WorkspacePins

    (user_ws / "vendor" / "lib" / ".git").mkdir(parents=True)
    for i in range(20):
        (user_ws / f"fill{i}").mkdir()
    groups = WorkspaceGroups(920_000, 16, str(tmp_path / "groups"))
    groups.setup()
    pins = WorkspacePins(groups, 920_999, None, lambda uid: uid == 999)

    async def bound() -> list[str]:
        pinned = await pins.open(str(user_ws), "s-bound", None, shell=True,
                                 git_writable=False)
        try:
            return [rel for _, rel in pinned.git_fds]
        finally:
            await pins.release(pinned)

    assert await bound() == ["vendor/", "vendor/lib/", "vendor/lib/.git"]
    monkeypatch.setattr(workspace, "MAX_ENTRIES", 3)
    monkeypatch.setattr(ownership, "RELEASE_MAX_ENTRIES", 3)
    monkeypatch.setattr(ownership, "MAX_ENTRIES", 3)
    for _ in range(2):  # the walks see 3 entries now; the repository stays bound
        assert await bound() == ["vendor/", "vendor/lib/", "vendor/lib/.git"]
