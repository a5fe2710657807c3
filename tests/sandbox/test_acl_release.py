"""The per-call grant and its release, on the disk (no stack): after a release
every entry's ACLs are exactly what they were before the grant (the user's own
entries, masks and default ACLs included), what tools created carries no
Corral entry and belongs to the owner, nothing outside the workspace is
touched, and a release bounded by its entry limit says so.

(Through the real worker and sandbox: ``test_acl_calls.py``.)
"""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox_worker.sandbox import ownership
from sandbox_worker.sandbox.acl import (
    ACL_GROUP,
    ACL_GROUP_OBJ,
    ACL_MASK,
    ACL_OTHER,
    ACL_USER,
    ACL_USER_OBJ,
    UNDEFINED_ID,
    XATTR_ACCESS,
    XATTR_DEFAULT,
    decode_acl,
    encode_acl,
)
from sandbox_worker.sandbox.workspace import grant_tree
from tests.helpers import searchable_dir

pytestmark = pytest.mark.sandbox

OWNER = 4242
GID = 777_010  # the workspace's group in these tests
OTHER_WS_GID = 777_011  # another workspace's (a leftover of an older grant)
LEGACY = 777_012  # the old shared sandbox group's gid, in the worker
TOOL_UIDS = range(900_000, 900_010)
U, G, M, OTH = ACL_USER_OBJ, ACL_GROUP_OBJ, ACL_MASK, ACL_OTHER
X = UNDEFINED_ID


def is_ours(gid: int) -> bool:
    return gid in (GID, OTHER_WS_GID, LEGACY)


def is_tool(uid: int) -> bool:
    return uid in TOOL_UIDS


@pytest.fixture
def ws() -> Iterator[Path]:
    with searchable_dir("corral-aclws-", "/tmp") as path:
        os.chown(path, OWNER, OWNER)
        yield path


def _xattr(path: Path, name: str) -> bytes | None:
    try:
        return os.getxattr(path, name, follow_symlinks=False)
    except OSError:
        return None


def snapshot(root: Path) -> dict[str, tuple[int, int, int, bytes | None, bytes | None]]:
    """Every entry's mode, owner, group and raw ACL xattrs, as the disk has them."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in ["", *dirs, *files]:
            p = Path(dirpath) / name if name else Path(dirpath)
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_mode, st.st_uid, st.st_gid,
                                             _xattr(p, XATTR_ACCESS), _xattr(p, XATTR_DEFAULT))
    return out


def corral_left(root: Path) -> list[str]:
    """Entries still carrying anything Corral adds: an entry of a Corral gid,
    or an entry owned by a tool uid."""
    bad = []
    for rel, (_mode, uid, _gid, acc, dft) in snapshot(root).items():
        for raw in (acc, dft):
            if raw and any(t == ACL_GROUP and is_ours(i) for t, i in decode_acl(raw)):
                bad.append(f"{rel}: entry {decode_acl(raw)}")
        if is_tool(uid):
            bad.append(f"{rel}: owned by {uid}")
    return bad


def _setacl(path: Path, name: str, entries: dict[tuple[int, int], int]) -> None:
    os.setxattr(path, name, encode_acl(entries))


def build_user_tree(ws: Path, outside: Path) -> None:
    """A user's workspace with every kind of ACL a user may have set."""
    (ws / "plain").mkdir()
    (ws / "plain" / "f").write_text("x\n")
    # A file with the user's own extended ACL (user:4243 rw- under mask r--).
    (ws / "shared").write_text("x\n")
    _setacl(ws / "shared", XATTR_ACCESS, {(U, X): 6, (ACL_USER, 4243): 6, (G, X): 4,
                                           (M, X): 4, (OTH, X): 4})
    # A directory with the user's own default ACL (and a named group).
    (ws / "team").mkdir()
    _setacl(ws / "team", XATTR_DEFAULT, {(U, X): 7, (ACL_GROUP, 5000): 5, (G, X): 5,
                                          (M, X): 5, (OTH, X): 0})
    # A directory with a base-only default ACL (no named entry, no mask).
    (ws / "umaskdir").mkdir()
    _setacl(ws / "umaskdir", XATTR_DEFAULT, {(U, X): 7, (G, X): 0, (OTH, X): 0})
    # Read-only corner: 555 directory, 444 file.
    (ws / "ro").mkdir()
    (ws / "ro" / "f").write_text("keep\n")
    (ws / "ro" / "f").chmod(0o444)
    (ws / "ro").chmod(0o555)
    # A private file and one left over from an older grant (another gid's entry
    # is Corral's too).
    (ws / "priv").write_text("x\n")
    (ws / "priv").chmod(0o600)
    # Links: a hard link to a file outside, a symlink to a directory outside,
    # a fifo.
    target = outside / "t"
    target.write_text("outside\n")
    os.link(target, ws / "hl")
    (ws / "sl").symlink_to(outside)
    os.mkfifo(ws / "fifo")
    for dirpath, dirs, files in os.walk(ws):
        for name in [*dirs, *files]:
            os.chown(Path(dirpath) / name, OWNER, OWNER, follow_symlinks=False)
    os.chown(target, 0, 0)


def tool_creates(ws: Path) -> None:
    """What a call's tools leave: new entries (inheriting the granted default
    ACLs), owned by a tool uid, some with setid bits."""
    (ws / "new").mkdir()
    (ws / "new" / "deep").mkdir()
    (ws / "new" / "deep" / "f").write_text("made\n")
    (ws / "team" / "t").write_text("in the user's default ACL\n")
    (ws / "team" / "sub").mkdir()
    (ws / "umaskdir" / "u").write_text("u\n")
    (ws / "plain" / "g").write_text("g\n")
    os.mkfifo(ws / "new" / "pipe")
    (ws / "new" / "link").symlink_to("/etc/shadow")
    os.link(ws / "new" / "deep" / "f", ws / "new" / "f2")  # a link inside the workspace
    for p in (ws / "new", ws / "new" / "deep", ws / "new" / "deep" / "f", ws / "team" / "t",
              ws / "team" / "sub", ws / "umaskdir" / "u", ws / "plain" / "g",
              ws / "new" / "pipe", ws / "new" / "link"):
        os.chown(p, TOOL_UIDS[1], GID, follow_symlinks=False)
    os.chmod(ws / "new" / "deep" / "f", 0o6755)


def _grant(ws: Path) -> None:
    fd = os.open(ws, os.O_PATH | os.O_DIRECTORY)
    try:
        grant_tree(fd, GID, is_ours)
    finally:
        os.close(fd)


def _release(ws: Path) -> ownership.SweepReport:
    fd = os.open(ws, os.O_PATH | os.O_DIRECTORY)
    try:
        return ownership.release(fd, is_tool, is_ours)
    finally:
        os.close(fd)


@pytest.fixture
def outside() -> Iterator[Path]:
    with searchable_dir("corral-outside-", "/var/tmp") as path:
        yield path


def test_release_restores_every_acl_exactly(ws: Path, outside: Path) -> None:
    build_user_tree(ws, outside)
    before = snapshot(ws)
    out_before = snapshot(outside)
    _grant(ws)
    granted = snapshot(ws)
    assert granted != before  # the grant is in force...
    assert (ACL_GROUP, GID) in decode_acl(granted["plain/f"][3] or b"")
    assert (ACL_GROUP, GID) in decode_acl(granted["team"][3] or b"")
    # Default ACLs are never written: the user's stay as they are, none is added.
    assert all(granted[rel][4] == entry[4] for rel, entry in before.items())
    # ...never more than the owner has (the read-only corner stays read-only),
    # and the user's mask is kept.
    assert decode_acl(granted["ro/f"][3] or b"")[(ACL_GROUP, GID)] == 4
    assert decode_acl(granted["shared"][3] or b"")[(M, X)] == 4
    assert decode_acl(granted["shared"][3] or b"")[(ACL_GROUP, GID)] == 6  # the owner's rw-
    assert granted["hl"][3] is None  # a hard link may lead outside: never granted
    _release(ws)
    assert snapshot(ws) == before
    assert corral_left(ws) == []
    assert snapshot(outside) == out_before


def test_release_leaves_what_tools_created_plain_and_the_owners(ws: Path,
                                                               outside: Path) -> None:
    build_user_tree(ws, outside)
    before = snapshot(ws)
    _grant(ws)
    tool_creates(ws)
    report = _release(ws)
    assert report.complete
    after = snapshot(ws)
    assert corral_left(ws) == []
    for rel, entry in before.items():
        if rel not in ("", "plain", "team", "umaskdir", "new"):  # their mtimes moved
            assert after[rel][:5] == entry[:5], rel
    for rel in ("new", "new/deep", "new/deep/f", "new/pipe", "plain/g", "umaskdir/u"):
        _mode, uid, gid, acc, dft = after[rel]
        assert (uid, gid) == (OWNER, OWNER), rel
        assert (acc, dft) == (None, None), rel  # plain modes again
    assert not after["new/deep/f"][0] & (stat.S_ISUID | stat.S_ISGID)
    # Inside the user's default ACL, new entries keep what it gave them, minus ours.
    t_acl = decode_acl(after["team/t"][3] or b"")
    assert (ACL_GROUP, 5000) in t_acl
    assert not any(is_ours(i) for _, i in t_acl)
    sub_default = decode_acl(after["team/sub"][4] or b"")
    assert (ACL_GROUP, 5000) in sub_default
    assert (ACL_GROUP, GID) not in sub_default
    assert os.readlink(ws / "new" / "link") == "/etc/shadow"
    assert Path("/etc/shadow").stat().st_uid == 0


def test_grant_and_release_replace_another_corral_groups_leftovers(ws: Path,
                                                                   outside: Path) -> None:
    """Entries of another Corral gid (an older grant, a crash) are removed too;
    the user's own entries stay."""
    (ws / "f").write_text("x\n")
    os.chown(ws / "f", OWNER, OWNER)
    _setacl(ws / "f", XATTR_ACCESS, {(U, X): 6, (ACL_USER, 4243): 4, (ACL_GROUP, OTHER_WS_GID): 6,
                                     (G, X): 4, (M, X): 6, (OTH, X): 4})
    _grant(ws)
    acl = decode_acl(os.getxattr(ws / "f", XATTR_ACCESS))
    assert (ACL_GROUP, OTHER_WS_GID) not in acl
    assert (ACL_GROUP, GID) in acl
    _release(ws)
    acl = decode_acl(os.getxattr(ws / "f", XATTR_ACCESS))
    assert acl == {(U, X): 6, (ACL_USER, 4243): 4, (G, X): 4, (M, X): 6, (OTH, X): 4}


def test_release_is_bounded_and_says_so(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for i in range(30):
        (ws / f"f{i}").write_text("x")
    _grant(ws)
    monkeypatch.setattr(ownership, "RELEASE_MAX_ENTRIES", 10)
    report = _release(ws)
    assert not report.complete
    assert report.entries == 10
    assert corral_left(ws)  # what the walk did not reach keeps its entries...
    monkeypatch.undo()
    assert _release(ws).complete  # ...until the next release
    assert corral_left(ws) == []


def test_grants_left_by_dead_calls_are_revoked_exactly(ws: Path, outside: Path) -> None:
    """Grants of calls that never released (a killed worker), granted again by
    the next call: one release restores everything."""
    build_user_tree(ws, outside)
    before = snapshot(ws)
    for _ in range(3):
        _grant(ws)
    _release(ws)
    assert snapshot(ws) == before


def test_a_chmod_during_the_call_is_not_undone(ws: Path) -> None:
    """``chmod 600`` on a granted file lowers its mask only; dropping the mask
    must leave the owning group what the mask let it have, not its old bits."""
    (ws / "mine").write_text("x\n")
    (ws / "mine").chmod(0o640)
    os.chown(ws / "mine", OWNER, OWNER)
    _grant(ws)
    (ws / "mine").chmod(0o600)
    _release(ws)
    assert stat.S_IMODE((ws / "mine").stat().st_mode) == 0o600
    assert _xattr(ws / "mine", XATTR_ACCESS) is None


def test_default_acls_of_older_grants_are_removed_and_the_users_kept(ws: Path) -> None:
    """Older versions wrote default ACLs (base entries, their group, a mask, and
    ``user:<owner>``): a release leaves what is not a Corral entry."""
    old, mixed = ws / "old", ws / "mixed"
    for d in (old, mixed):
        d.mkdir()
    _setacl(old, XATTR_DEFAULT, {(U, X): 7, (ACL_GROUP, LEGACY): 7, (G, X): 5, (M, X): 7,
                                 (OTH, X): 5})
    _setacl(mixed, XATTR_DEFAULT, {(U, X): 7, (ACL_GROUP, OTHER_WS_GID): 7, (ACL_USER, OWNER): 7,
                                   (G, X): 5, (M, X): 7, (OTH, X): 5})
    _release(ws)
    assert _xattr(old, XATTR_DEFAULT) is None
    assert decode_acl(_xattr(mixed, XATTR_DEFAULT) or b"") == {
        (U, X): 7, (ACL_USER, OWNER): 7, (G, X): 5, (M, X): 7, (OTH, X): 5}


@pytest.mark.parametrize("walk", ["release", "normalise"])
def test_acls_and_modes_a_tool_set_on_its_own_files_do_not_outlive_it(
        ws: Path, walk: str) -> None:
    """A tool owns what it creates, so it may ``setfacl`` it (naming a host
    user) or make it world-writable; once the owner owns it, none of that may
    give a host user reach. (``normalise`` runs while other calls still hold
    the grant: ours stays there, the tool's goes.)"""
    _grant(ws)
    gift, opened = ws / "gift", ws / "open"
    gift.write_text("x\n")
    opened.mkdir()
    for p in (gift, opened):
        os.chown(p, TOOL_UIDS[2], GID)
    _setacl(gift, XATTR_ACCESS, {(U, X): 6, (ACL_USER, 4243): 7, (ACL_GROUP, 0): 7,
                                 (ACL_GROUP, GID): 6, (G, X): 4, (M, X): 7, (OTH, X): 6})
    _setacl(opened, XATTR_DEFAULT, {(U, X): 7, (ACL_USER, 4243): 7, (G, X): 5, (M, X): 7,
                                    (OTH, X): 7})
    opened.chmod(0o777)
    if walk == "release":
        _release(ws)
    else:
        fd = os.open(ws, os.O_PATH | os.O_DIRECTORY)
        try:
            ownership.normalise(fd, is_tool, grant=(GID, is_ours))
        finally:
            os.close(fd)
    for p in (gift, opened):
        st = p.stat()
        assert (st.st_uid, st.st_mode & 0o002) == (OWNER, 0), p
    gift_acl = decode_acl(_xattr(gift, XATTR_ACCESS) or encode_acl({}))
    assert (ACL_USER, 4243) not in gift_acl
    assert (ACL_GROUP, 0) not in gift_acl
    opened_default = decode_acl(_xattr(opened, XATTR_DEFAULT) or encode_acl({}))
    assert (ACL_USER, 4243) not in opened_default
    if walk == "release":
        assert corral_left(ws) == []
    else:
        assert (ACL_GROUP, GID) in gift_acl  # the grant is still in force


def test_a_workspace_on_a_read_only_filesystem_is_left_as_it_is(ws: Path) -> None:
    """Nothing can be granted (nor needs revoking): the grant says so instead
    of failing the call, and the release writes nothing."""
    (ws / "f").write_text("x\n")
    before = snapshot(ws)
    with searchable_dir("corral-romount-", "/tmp") as ro:
        subprocess.run(["mount", "--bind", str(ws), str(ro)], check=True, timeout=30)
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True, timeout=30)
            fd = os.open(ro, os.O_PATH | os.O_DIRECTORY)
            try:
                assert grant_tree(fd, GID, is_ours).read_only_fs
                assert ownership.release(fd, is_tool, is_ours).complete
            finally:
                os.close(fd)
        finally:
            subprocess.run(["umount", str(ro)], check=True, timeout=30)
    assert snapshot(ws) == before
