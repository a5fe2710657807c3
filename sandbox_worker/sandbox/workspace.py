"""Pinning a user's workspace by identity, and granting it to its group for a call.

**Pinning.** A session's workspace is the directory its path named when the
session was created, identified by ``(st_dev, st_ino)`` (the supervisor
records it; the worker pins it at the first call of a session it has no
record for). Every call opens it once, as root, with ``openat2(AT_FDCWD,
real path, O_PATH | O_DIRECTORY, RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)``
and compares the identity (``open_pinned``): a symlink swapped in anywhere on
the path, or a directory renamed into its place, is refused. Everything after
that -- the grant, the sandbox bind (bwrap ``--bind-fd``, which checks the
mount against the fd), the file tools -- goes through that fd, never through
the path again.

**The grant.** A workspace is typically owned by its user (root included),
mode 0755, so the non-root tool processes could not write to it. Every shell
call runs as its own uid (``uidpool.py``), all calls of one workspace with
that workspace's own group (``wsgroups.py``), and the file tools with the
sandbox user's uid and that group. So for every call the worker (root) adds
a ``group:<ws>:<owner's bits>`` access ACL entry to every directory and every
regular file with one link (``acl.grant_entry``: never more than the owner
has, so a read-only workspace -- dirs 555, files 444 -- stays read-only for
the sandbox; no default ACL), and removes it when the call ends
(``ownership.release``; ``wslease.py`` says which call of the workspace is
the last).

The walk is fd-relative: every entry is opened with ``O_PATH | O_NOFOLLOW``
beneath its pinned directory, so a symlink or a swapped entry is never
followed out of the workspace. Regular files with more than one link are
skipped: a hardlink may point outside the workspace and must not gain a
grant. The walk is bounded (``MAX_ENTRIES``; what lies beyond is not granted,
logged). On a read-only filesystem nothing is granted.

Invariants:
- Nothing outside the workspace is ever modified; the owner's own
  permissions are unchanged (only named entries and the mask are added), and
  the group's entry never holds a right the owner's mode bits lack.
- No path is resolved for a call after ``open_pinned``; a workspace whose
  identity differs from the pinned one is refused (``WorkspaceUnusable``).
- ``check_reachable`` refuses a workspace whose parents the sandbox uid
  cannot search, naming the directory and the command that fixes it.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from sandbox_worker.sandbox.acl import XATTR_ACCESS, grant_entry
from sandbox_worker.sandbox.errors import WorkspaceUnusable
from sandbox_worker.sandbox.resolve import (
    AT_FDCWD,
    RESOLVE_NO_MAGICLINKS,
    RESOLVE_NO_SYMLINKS,
    openat2,
)
from sandbox_worker.sandbox.treewalk import entries, keep, reopen

log = logging.getLogger(__name__)

MAX_ENTRIES: Final = 200_000
MAX_GIT_DIRS: Final = 64  # .git entries reported (as ownership.MAX_GIT_DIRS)
FORBIDDEN_ROOTS: Final = ("/proc", "/sys", "/dev", "/etc", "/usr", "/boot", "/bin", "/sbin",
                          "/lib", "/lib64", "/run")
# Shared parents: granting one would give the sandbox everything created in it.
FORBIDDEN_EXACT: Final = frozenset({"/", "/tmp", "/var", "/var/tmp", "/home", "/root", "/opt",
                                    "/srv", "/mnt", "/media"})


@dataclass
class GrantReport:
    entries: int = 0
    changed: int = 0
    skipped_links: int = 0
    complete: bool = True
    read_only_fs: bool = False
    git: list[str] = field(default_factory=list)  # relative paths of .git entries seen


def grant_tree(root: int | str, sandbox_gid: int,
               is_ours: Callable[[int], bool] | None = None) -> GrantReport:
    """Grant the workspace's group the tree under ``root`` (a pinned fd, or a
    path opened without following a symlink) -- see the module docstring.
    ``is_ours`` names the Corral gids (other workspaces', the old shared
    group) whose entries are dropped on the way. Blocking."""
    ours = is_ours if is_ours is not None else (lambda g: g == sandbox_gid)
    try:
        return _grant_tree(root, sandbox_gid, ours)
    except OSError as exc:
        if exc.errno == errno.EROFS:
            # A read-only filesystem: nothing is granted, so the sandbox uses the
            # tree as its permissions let anyone (never more); nothing to revoke.
            log.info("workspace %s is on a read-only filesystem: not granted", root)
            return GrantReport(complete=False, read_only_fs=True)
        hint = ("mount its filesystem with POSIX ACL support, or make the workspace "
                f"writable by group {sandbox_gid} yourself"
                if exc.errno in (errno.EOPNOTSUPP, errno.ENOTSUP)
                else "check that the worker runs as root and the filesystem is writable")
        raise WorkspaceUnusable(f"cannot grant workspace {root} to the sandbox user: "
                                f"{exc.strerror or exc}", hint=hint) from exc


def _grant_tree(root: int | str, sandbox_gid: int, is_ours: Callable[[int], bool],
                ) -> GrantReport:
    report = GrantReport()
    root_fd = (os.dup(root) if isinstance(root, int) else
               os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC))
    try:
        # Directories to visit: an fd while few wait, else a path (treewalk.py).
        stack: list[tuple[int, str]] = [(os.dup(root_fd), "")]
        try:
            while stack:
                held, rel = stack.pop()
                dfd = reopen(root_fd, held, rel)
                if dfd is None:
                    continue  # gone, or no longer a directory
                try:
                    _grant_dir(dfd, rel, sandbox_gid, is_ours, report, stack)
                finally:
                    os.close(dfd)
        finally:
            for held, _ in stack:
                if held >= 0:
                    os.close(held)
    finally:
        os.close(root_fd)
    if not report.complete:
        log.warning("workspace %s has more than %d entries; granted only the first ones",
                    root, MAX_ENTRIES)
    return report


def _grant_dir(dfd: int, rel: str, sandbox_gid: int, is_ours: Callable[[int], bool],
               report: GrantReport, stack: list[tuple[int, str]]) -> None:
    """Grant the directory ``dfd`` and its entries; push its subdirectories."""
    st = os.fstat(dfd)
    report.entries += 1
    report.changed += grant_entry(dfd, st, sandbox_gid, is_ours)
    for entry in entries(dfd):  # read lazily: no further than the bound
        if report.entries >= MAX_ENTRIES:
            report.complete = False
            break
        name = entry.name
        try:
            fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        except OSError:
            continue
        try:
            cst = os.fstat(fd)
            if name == ".git" and len(report.git) < MAX_GIT_DIRS:
                report.git.append(f"{rel}{name}")
            if stat.S_ISDIR(cst.st_mode):
                stack.append((keep(fd, len(stack)), f"{rel}{name}/"))
                fd = -1
                continue
            report.entries += 1
            if stat.S_ISREG(cst.st_mode) and cst.st_nlink > 1:
                report.skipped_links += 1
            else:
                report.changed += grant_entry(fd, cst, sandbox_gid, is_ours)
        finally:
            if fd >= 0:
                os.close(fd)


def validate_workspace(path: object, workspace_root: str | None) -> str:
    """An absolute, existing, non-system directory; returns its real path."""
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise WorkspaceUnusable(f"workspace must be an absolute path, got {path!r}")
    real = os.path.realpath(path)
    if real in FORBIDDEN_EXACT or any(real == r or real.startswith(r + "/")
                                      for r in FORBIDDEN_ROOTS):
        raise WorkspaceUnusable(f"workspace {real} is a system directory; refusing")
    if workspace_root is not None:
        base = os.path.realpath(workspace_root)
        if real != base and not real.startswith(base.rstrip("/") + "/"):
            raise WorkspaceUnusable(f"workspace {real} is not under the worker's "
                                    f"workspace root {base}")
    if not os.path.isdir(real):
        raise WorkspaceUnusable(f"workspace {real} does not exist or is not a directory")
    return real


def open_pinned(real: str, identity: tuple[int, int] | None) -> int:
    """An O_PATH fd of the workspace ``real`` (a resolved path), opened with no
    symlink followed anywhere on the way, whose ``(st_dev, st_ino)`` must equal
    ``identity`` when one is given. The caller closes it. Blocking."""
    try:
        fd = openat2(AT_FDCWD, real, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW,
                     resolve=RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise WorkspaceUnusable(
                f"workspace {real} now goes through a symlink; it was replaced after its "
                "session began, refusing", hint="start a new session on the real "
                "directory") from exc
        raise WorkspaceUnusable(f"workspace {real}: {exc.strerror}",
                                hint="check that the directory still exists") from exc
    if identity is not None:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != tuple(identity):
            os.close(fd)
            raise WorkspaceUnusable(
                f"workspace {real} is no longer the directory its session was created with "
                f"(device/inode {st.st_dev}/{st.st_ino}, pinned {identity[0]}/{identity[1]}): "
                "it was replaced or moved; refusing",
                hint="start a new session on the directory you mean")
    return fd


def check_reachable(real: str) -> None:
    """Refuse a workspace whose parent directories others cannot search."""
    parts = real.strip("/").split("/")
    for i in range(len(parts) - 1):
        parent = "/" + "/".join(parts[: i + 1])
        mode = os.stat(parent).st_mode
        if not mode & stat.S_IXOTH:
            has_acl = True
            try:
                os.getxattr(parent, XATTR_ACCESS)
            except OSError:
                has_acl = False
            if not has_acl:
                raise WorkspaceUnusable(
                    f"workspace {real} is not reachable by the sandbox user: {parent} is "
                    f"mode {stat.S_IMODE(mode):04o}",
                    hint=f"let it pass through: chmod o+x {parent} (or choose a workspace "
                    "under a searchable directory)",
                )
