"""After a call: what tools created belongs to the workspace's owner, with no setuid or setgid bit.

Shell calls run as per-call uids and the file tools as the sandbox user, so
what they create is owned by a uid the workspace's owner cannot manage (no
``chmod``, no ``chown``), and a setuid/setgid file a tool left would hand any
host user that uid or the workspace's group. Seccomp refuses every mode with
S_ISUID or S_ISGID inside the sandbox (``seccomp.py``); this sweep is the
second layer, and the only one at T0 (no seccomp) -- run by the worker (root)
after every call that may have changed the workspace, before the call's uid
is given back:

- every entry owned by a tool uid (the per-call range, or the file tools'
  uid) is chowned to the workspace root's owner and group, without following
  a symlink (``fchownat(..., AT_SYMLINK_NOFOLLOW)`` beneath a pinned
  directory fd), and loses the ``user:<owner>`` ACL entry it inherited (the
  owner owns it now; only the workspace group's entry stays);
- S_ISUID and S_ISGID are cleared on every such entry that is not a
  directory; a directory keeps S_ISGID only when its parent has it (the
  kernel's inheritance) and never keeps S_ISUID;
- ``.git`` entries seen on the way are reported, so the next call can bind
  them read-only (``profile.py``).

The walk is fd-relative with ``O_PATH | O_NOFOLLOW`` like the grant, bounded
by ``MAX_ENTRIES``, and never leaves the workspace. Files of the owner (or of
anyone else) are never changed: a tool can chmod only what it owns.

Invariants:
- After ``normalise`` returns, no entry under the root is owned by a tool uid
  or carries S_ISUID/S_ISGID set by a tool, unless the walk was cut at
  ``MAX_ENTRIES`` (logged) or an entry appeared while it ran.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from sandbox_worker.sandbox.workspace import (
    ACL_USER,
    XATTR_ACCESS,
    decode_acl,
    encode_acl,
)

log = logging.getLogger(__name__)

MAX_ENTRIES: Final = 200_000
MAX_GIT_DIRS: Final = 64
SETID: Final = stat.S_ISUID | stat.S_ISGID


@dataclass
class SweepReport:
    entries: int = 0
    chowned: int = 0
    stripped: int = 0
    complete: bool = True
    git: list[str] = field(default_factory=list)  # relative paths of .git entries


def _strip(dfd: int, name: str, mode: int, parent_setgid: bool) -> bool:
    """Clear the setid bits a tool may have left; True if the mode changed."""
    if not mode & SETID:
        return False
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    try:
        st = os.fstat(fd)  # after the chown, which may have cleared some already
        keep = stat.S_ISGID if stat.S_ISDIR(st.st_mode) and parent_setgid else 0
        bad = st.st_mode & SETID & ~keep
        if not bad or stat.S_ISLNK(st.st_mode):
            return False
        # chmod through the fd's magic link: the inode checked, no path re-resolved.
        os.chmod(f"/proc/self/fd/{fd}", stat.S_IMODE(st.st_mode) & ~bad)
    finally:
        os.close(fd)
    return True


def _visit(entry: os.DirEntry[str], dfd: int, rel: str, setgid: bool, fresh: bool,
           owner: int, group: int, is_tool_uid: Callable[[int], bool], report: SweepReport,
           stack: list[tuple[int, str, bool, bool]]) -> None:
    name = entry.name
    path = f"{rel}{name}"
    if name == ".git" and len(report.git) < MAX_GIT_DIRS:
        report.git.append(path)
    try:
        if not fresh:  # d_type is enough to find the directories below
            if entry.is_dir(follow_symlinks=False):
                cfd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC,
                              dir_fd=dfd)
                stack.append((cfd, f"{path}/", bool(os.fstat(cfd).st_mode & stat.S_ISGID),
                              False))
            return
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        tools = is_tool_uid(st.st_uid)
        if tools:
            os.chown(name, owner, group, dir_fd=dfd, follow_symlinks=False)
            report.chowned += 1
            _drop_owner_entry(dfd, name, owner)
            if _strip(dfd, name, st.st_mode, setgid):
                report.stripped += 1
        if stat.S_ISDIR(st.st_mode):
            cfd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC,
                          dir_fd=dfd)
            stack.append((cfd, f"{path}/", bool(st.st_mode & stat.S_ISGID), tools))
    except OSError:
        return  # vanished or replaced meanwhile


def _drop_owner_entry(dfd: int, name: str, owner: int) -> None:
    """Remove the ``user:<owner>`` entry a new entry inherited from its parent's
    default ACL: once the owner owns it, the entry adds nothing."""
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    try:
        if stat.S_ISLNK(os.fstat(fd).st_mode):
            return
        path = f"/proc/self/fd/{fd}"
        try:
            acl = decode_acl(os.getxattr(path, XATTR_ACCESS))
        except (OSError, ValueError):
            return
        if (ACL_USER, owner) in acl:
            # The mask stays as the creator's mode made it: never widen.
            del acl[(ACL_USER, owner)]
            os.setxattr(path, XATTR_ACCESS, encode_acl(acl))
    finally:
        os.close(fd)


def normalise(root_fd: int, is_tool_uid: Callable[[int], bool],
              since: float | None = None) -> SweepReport:
    """Give tool-created entries under ``root_fd`` (a pinned workspace fd) to the
    root's owner and clear their setid bits (see the module docstring). With
    ``since`` (a wall-clock time before the call began), only the entries of
    directories modified since then, or created by a tool, are examined: a
    new entry changes its directory's mtime, and a tool can neither set an
    older mtime on a directory it does not own nor change an entry it did not
    create in this call (earlier ones were swept). Blocking."""
    report = SweepReport()
    root = os.fstat(root_fd)
    owner, group = root.st_uid, root.st_gid
    if is_tool_uid(owner):
        return report  # a workspace owned by a tool uid: nobody to give it to
    # (directory O_PATH fd, relative path, parent setgid, created by a tool)
    stack: list[tuple[int, str, bool, bool]] = [
        (os.dup(root_fd), "", bool(root.st_mode & stat.S_ISGID), False)]
    try:
        while stack:
            dfd, rel, setgid, forced = stack.pop()
            try:
                fresh = forced or since is None or os.fstat(dfd).st_mtime >= since
                rfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dfd)
                try:
                    with os.scandir(rfd) as it:
                        for entry in it:
                            if report.entries >= MAX_ENTRIES:
                                report.complete = False
                                break
                            report.entries += 1
                            _visit(entry, dfd, rel, setgid, fresh, owner, group, is_tool_uid,
                                   report, stack)
                finally:
                    os.close(rfd)
            except OSError:
                pass
            finally:
                os.close(dfd)
    finally:
        for dfd, *_ in stack:
            os.close(dfd)
    if not report.complete:
        log.warning("workspace sweep stopped at %d entries", MAX_ENTRIES)
    return report
