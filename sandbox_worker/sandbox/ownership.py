"""After a call: what tools created goes to the workspace's owner, and the grant is revoked.

Shell calls run as per-call uids and the file tools as the sandbox user, so
what they create is owned by a uid the workspace's owner cannot manage (no
``chmod``, no ``chown``), and a setuid/setgid file a tool left would hand any
host user that uid or the workspace's group. Seccomp refuses every mode with
S_ISUID or S_ISGID inside the sandbox (``seccomp.py``); this module is the
second layer, and the only one at T0 (no seccomp) -- run by the worker (root)
after every call, once the call's processes are gone and before its uid is
given back. For every entry a tool uid (the per-call range, or the file
tools' uid) owns:

- it is chowned to the workspace root's owner and group, without following
  a symlink (through the entry's own ``O_PATH | O_NOFOLLOW`` fd);
- S_ISUID and S_ISGID are cleared (a directory keeps S_ISGID only when its
  parent has it, the kernel's inheritance), and so is the write bit for
  others: a world-writable file or directory a tool left would let any host
  user write into the owner's workspace;
- its ACLs are bounded by its parent's default ACL (``acl.confine_entry``):
  entries the tool set itself (``setfacl -m u:4243:rwx``, possible on what
  it owned) are removed.

Two walks, both fd-relative with ``O_PATH | O_NOFOLLOW`` and never leaving
the workspace:

- ``release`` (no other call uses the workspace, ``wslease.py``): the whole
  tree, top down; besides the above, every ACL entry Corral added is revoked
  (``acl.revoke_entry``). A directory is fixed before it is listed, so once
  the walk has passed it, no tool uid can create anything in it.
- ``normalise`` (other calls of the workspace still run, so the grant stays,
  and what is given to the owner is granted to the group like the rest): only
  directories changed since the call began (or created by a tool) are
  examined -- a new entry changes its directory's mtime, and a tool cannot
  set an older mtime on a directory it does not own.

``.git`` entries seen on the way are reported, so the next call can bind
them read-only (``profile.py``).

Invariants:
- Entries of the owner (or of anyone else) keep their owner and mode; only
  Corral's ACL entries are removed from them.
- After ``release`` returns complete, no entry under the root is owned by a
  tool uid, carries setid bits or o+w set by a tool, or has an ACL entry of
  a Corral gid; at ``RELEASE_MAX_ENTRIES`` it stops (logged,
  ``complete`` false) and the rest waits for the next release.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from sandbox_worker.sandbox.acl import (
    XATTR_DEFAULT,
    Entries,
    confine_entry,
    grant_entry,
    read_acl,
    revoke_entry,
)
from sandbox_worker.sandbox.treewalk import entries, keep, reopen

log = logging.getLogger(__name__)

MAX_ENTRIES: Final = 200_000
# The release walks what was granted (at most workspace.MAX_ENTRIES) plus
# what the call created meanwhile.
RELEASE_MAX_ENTRIES: Final = 400_000
MAX_GIT_DIRS: Final = 64
SETID: Final = stat.S_ISUID | stat.S_ISGID
NOFOLLOW: Final = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC

# (directory O_PATH fd, relative path, its setgid bit, its default ACL, examine its
# entries' owners -- always, but in normalise's directories unchanged since the call)
Frame = tuple[int, str, bool, "Entries | None", bool]


@dataclass
class SweepReport:
    entries: int = 0
    chowned: int = 0
    stripped: int = 0
    revoked: int = 0
    complete: bool = True
    git: list[str] = field(default_factory=list)  # relative paths of .git entries


def _fix_mode(fd: int, parent_setgid: bool) -> bool:
    """Clear the setid bits and o+w a tool may have left; True if the mode changed."""
    st = os.fstat(fd)  # after the chown, which may have cleared some already
    if stat.S_ISLNK(st.st_mode):
        return False
    keep = stat.S_ISGID if stat.S_ISDIR(st.st_mode) and parent_setgid else 0
    bad = st.st_mode & (SETID | stat.S_IWOTH) & ~keep
    if not bad:
        return False
    # chmod through the fd's magic link: the inode checked, no path re-resolved.
    os.chmod(f"/proc/self/fd/{fd}", stat.S_IMODE(st.st_mode) & ~bad)
    return True


def _give(dfd: int, name: str, fd: int, st: os.stat_result, owner: int, group: int,
          setgid: bool, parent_default: Entries | None, report: SweepReport) -> None:
    """A tool's entry: to the owner, setid and o+w cleared, ACLs confined."""
    if stat.S_ISLNK(st.st_mode):
        os.chown(name, owner, group, dir_fd=dfd, follow_symlinks=False)
    else:
        os.chown(f"/proc/self/fd/{fd}", owner, group)
    report.chowned += 1
    if _fix_mode(fd, setgid):
        report.stripped += 1
    confine_entry(fd, os.fstat(fd), parent_default)


def _walk(report: SweepReport, limit: int,
          visit: Callable[[int, os.DirEntry[str], str, Frame, list[Frame]], None],
          root_fd: int, first: Frame) -> None:
    """Visit the tree of ``first`` (the root's frame) top down, at most
    ``limit`` entries; ``visit`` pushes the directories to list next, each
    with ``treewalk.keep`` (at most ``HELD_FDS_MAX`` fds held: the rest are
    reopened beneath ``root_fd`` by path)."""
    stack: list[Frame] = [first]
    try:
        while stack:
            frame = stack.pop()
            rel = frame[1]
            dfd = reopen(root_fd, frame[0], rel)
            if dfd is None:
                continue  # gone, or no longer a directory
            try:
                for entry in entries(dfd):  # read lazily: no further than the bound
                    if report.entries >= limit:
                        report.complete = False
                        break
                    report.entries += 1
                    if entry.name == ".git" and len(report.git) < MAX_GIT_DIRS:
                        report.git.append(f"{rel}{entry.name}")
                    visit(dfd, entry, f"{rel}{entry.name}", frame, stack)
            except OSError:
                pass  # vanished or replaced meanwhile
            finally:
                os.close(dfd)
    finally:
        for frame in stack:
            if frame[0] >= 0:
                os.close(frame[0])


def release(root_fd: int, is_tool_uid: Callable[[int], bool],
            is_ours: Callable[[int], bool]) -> SweepReport:
    """The whole tree under ``root_fd`` (a pinned workspace fd), top down: tool
    entries given to the owner and every Corral ACL entry revoked (see the
    module docstring). Blocking."""
    report = SweepReport()
    root = os.fstat(root_fd)
    owner, group = root.st_uid, root.st_gid
    give = not is_tool_uid(owner)  # a workspace owned by a tool uid: nobody to give it to
    changed, root_default = revoke_entry(root_fd, root, is_ours)
    report.revoked += changed

    def visit(dfd: int, entry: os.DirEntry[str], path: str, frame: Frame,
              stack: list[Frame]) -> None:
        name = entry.name
        try:
            fd = os.open(name, NOFOLLOW, dir_fd=dfd)
        except OSError:
            return
        try:
            st = os.fstat(fd)
            if give and is_tool_uid(st.st_uid):
                _give(dfd, name, fd, st, owner, group, frame[2], frame[3], report)
                st = os.fstat(fd)
            changed, default = revoke_entry(fd, st, is_ours)
            report.revoked += changed
            if stat.S_ISDIR(st.st_mode):
                stack.append((keep(fd, len(stack)), f"{path}/", bool(st.st_mode & stat.S_ISGID),
                              default, True))
                fd = -1
        except OSError:
            pass  # replaced meanwhile
        finally:
            if fd >= 0:
                os.close(fd)

    _walk(report, RELEASE_MAX_ENTRIES, visit, root_fd,
          (os.dup(root_fd), "", bool(root.st_mode & stat.S_ISGID), root_default, True))
    if not report.complete:
        log.warning("workspace release stopped at %d entries", RELEASE_MAX_ENTRIES)
    return report


def _default_of(fd: int) -> Entries | None:
    try:
        return read_acl(f"/proc/self/fd/{fd}", XATTR_DEFAULT, 0)
    except (OSError, ValueError):
        return None


def normalise(root_fd: int, is_tool_uid: Callable[[int], bool],
              since: float | None = None, grant: tuple[int, Callable[[int], bool]] | None = None,
              ) -> SweepReport:
    """Give tool-created entries under ``root_fd`` (a pinned workspace fd) to the
    root's owner (see the module docstring), the grant left in force: with
    ``grant`` (the workspace's gid, the Corral gids) each entry given is
    granted to the group as the call's grant did (the calls still running use
    it). With ``since`` (a wall-clock time before the call began), only the
    entries of directories modified since then, or created by a tool, are
    examined. Blocking."""
    report = SweepReport()
    root = os.fstat(root_fd)
    owner, group = root.st_uid, root.st_gid
    if is_tool_uid(owner):
        return report

    def fresh(fd: int) -> bool:
        return since is None or os.fstat(fd).st_mtime >= since

    def visit(dfd: int, entry: os.DirEntry[str], path: str, frame: Frame,
              stack: list[Frame]) -> None:
        name = entry.name
        if not frame[4] and not entry.is_dir(follow_symlinks=False):
            return  # d_type is enough to find the directories below
        try:
            fd = os.open(name, NOFOLLOW, dir_fd=dfd)
        except OSError:
            return
        try:
            st = os.fstat(fd)
            tools = frame[4] and is_tool_uid(st.st_uid)
            if tools:
                _give(dfd, name, fd, st, owner, group, frame[2], frame[3], report)
                st = os.fstat(fd)
                if grant is not None:
                    grant_entry(fd, st, *grant)
            if stat.S_ISDIR(st.st_mode):
                examine = tools or fresh(fd)
                stack.append((keep(fd, len(stack)), f"{path}/",
                              bool(st.st_mode & stat.S_ISGID),
                              _default_of(fd) if examine else None, examine))
                fd = -1
        except OSError:
            pass
        finally:
            if fd >= 0:
                os.close(fd)

    # A directory not examined is still listed, for the directories below it.
    examine_root = fresh(root_fd)
    first: Frame = (os.dup(root_fd), "", bool(root.st_mode & stat.S_ISGID),
                    _default_of(root_fd) if examine_root else None, examine_root)
    _walk(report, MAX_ENTRIES, visit, root_fd, first)
    if not report.complete:
        log.warning("workspace sweep stopped at %d entries", MAX_ENTRIES)
    return report
