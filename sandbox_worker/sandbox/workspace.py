"""Pinning a user's workspace by identity, and giving it to its group with POSIX ACLs.

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
sandbox user's uid and that group. So the worker (root) adds *group* ACL
entries, once per workspace (until its root carries the grant,
``is_granted``), and never more than the owner has:

- on every directory: ``group:<ws>:<owner's bits>`` and a *default* ACL with
  ``group:<ws>:<owner's bits>`` and ``user:<owner>:rwx``, so files created
  later by any call's uid, by the file tools or by the owner stay usable by
  all;
- on every regular file with one link: ``group:<ws>:<owner's bits>``, so a
  read-only workspace (dirs 555, files 444) stays read-only for the sandbox;
- an entry of the old shared sandbox group (``legacy_gid``) is removed.

ACLs are written as the ``system.posix_acl_*`` xattrs on file descriptors
opened with ``O_PATH | O_NOFOLLOW`` during an fd-relative walk, so a symlink
or a swapped entry is never followed out of the workspace. Regular files
with more than one link are skipped: a hardlink may point outside the
workspace and must not gain a grant. The walk is bounded (``MAX_ENTRIES``).

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
import struct
from dataclasses import dataclass
from typing import Final

from sandbox_worker.sandbox.errors import WorkspaceUnusable
from sandbox_worker.sandbox.resolve import (
    AT_FDCWD,
    RESOLVE_NO_MAGICLINKS,
    RESOLVE_NO_SYMLINKS,
    openat2,
)

log = logging.getLogger(__name__)

ACL_VERSION: Final = 2
ACL_USER_OBJ: Final = 0x01
ACL_USER: Final = 0x02
ACL_GROUP_OBJ: Final = 0x04
ACL_GROUP: Final = 0x08
ACL_MASK: Final = 0x10
ACL_OTHER: Final = 0x20
UNDEFINED_ID: Final = 0xFFFFFFFF
XATTR_ACCESS: Final = "system.posix_acl_access"
XATTR_DEFAULT: Final = "system.posix_acl_default"
MAX_ENTRIES: Final = 200_000
FORBIDDEN_ROOTS: Final = ("/proc", "/sys", "/dev", "/etc", "/usr", "/boot", "/bin", "/sbin",
                          "/lib", "/lib64", "/run")
# Shared parents: granting one would give the sandbox everything created in it.
FORBIDDEN_EXACT: Final = frozenset({"/", "/tmp", "/var", "/var/tmp", "/home", "/root", "/opt",
                                    "/srv", "/mnt", "/media"})

Entries = dict[tuple[int, int], int]  # (tag, id) -> perm bits (rwx = 7)


def decode_acl(raw: bytes) -> Entries:
    if len(raw) < 4 or struct.unpack_from("<I", raw)[0] != ACL_VERSION or (len(raw) - 4) % 8:
        raise ValueError("not a POSIX ACL xattr")
    out: Entries = {}
    for off in range(4, len(raw), 8):
        tag, perm, ident = struct.unpack_from("<HHI", raw, off)
        out[(tag, ident)] = perm
    return out


def encode_acl(entries: Entries) -> bytes:
    body = b"".join(struct.pack("<HHI", tag, entries[(tag, ident)], ident)
                    for tag, ident in sorted(entries))
    return struct.pack("<I", ACL_VERSION) + body


def _from_mode(mode: int) -> Entries:
    return {(ACL_USER_OBJ, UNDEFINED_ID): (mode >> 6) & 7,
            (ACL_GROUP_OBJ, UNDEFINED_ID): (mode >> 3) & 7,
            (ACL_OTHER, UNDEFINED_ID): mode & 7}


def _with_entries(entries: Entries, named: dict[tuple[int, int], int]) -> Entries:
    out = dict(entries)
    for key, perm in named.items():
        out[key] = out.get(key, 0) | perm
    return recompute_mask(out)


def recompute_mask(out: Entries) -> Entries:
    """The mask bounds every group-class entry; recompute it as their union,
    as setfacl does, so the named entries are effective (no mask without any)."""
    out = dict(out)
    out.pop((ACL_MASK, UNDEFINED_ID), None)
    if not any(tag in (ACL_USER, ACL_GROUP) for tag, _ in out):
        return out
    mask = 0
    for (tag, _), perm in out.items():
        if tag in (ACL_USER, ACL_GROUP, ACL_GROUP_OBJ):
            mask |= perm
    out[(ACL_MASK, UNDEFINED_ID)] = mask
    return out


def _read_acl(path: str, name: str, mode: int) -> Entries | None:
    try:
        return decode_acl(os.getxattr(path, name))
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.EOPNOTSUPP):
            return _from_mode(mode) if name == XATTR_ACCESS else None
        raise


def _keep_mask(before: Entries, after: Entries) -> Entries:
    """An ACL that already had a mask keeps it: raising it would widen every
    named entry and the owning group's effective rights (a user's ``user:bob``
    under mask ``r--``, or a file a tool made 0600). Our entry is then bounded
    by that mask, like anyone's."""
    mask = before.get((ACL_MASK, UNDEFINED_ID))
    if mask is None:
        return after
    return {**after, (ACL_MASK, UNDEFINED_ID): mask}


def _without(entries: Entries, gids: tuple[int, ...]) -> Entries:
    if not any((ACL_GROUP, g) in entries for g in gids):
        return entries
    return _with_entries({k: v for k, v in entries.items()
                          if not (k[0] == ACL_GROUP and k[1] in gids)}, {})


def grant_entry(fd: int, st: os.stat_result, sandbox_gid: int, owner_uid: int,
                legacy_gids: tuple[int, ...] = ()) -> bool:
    """Add the workspace group (and owner default) entries to one O_PATH fd,
    with the owner's own rights; drop entries of ``legacy_gids``. True if changed."""
    path = f"/proc/self/fd/{fd}"
    group = (ACL_GROUP, sandbox_gid)
    owner_bits = (st.st_mode >> 6) & 7
    if stat.S_ISDIR(st.st_mode) or (stat.S_ISREG(st.st_mode) and st.st_nlink == 1):
        named = {group: owner_bits}
    else:
        return False
    access = _read_acl(path, XATTR_ACCESS, st.st_mode)
    if access is None:
        return False
    new = _keep_mask(access, _with_entries(_without(access, legacy_gids), named))
    changed = False
    if new != access:
        os.setxattr(path, XATTR_ACCESS, encode_acl(new))
        changed = True
    if stat.S_ISDIR(st.st_mode):
        default = _without(_read_acl(path, XATTR_DEFAULT, st.st_mode) or _from_mode(0o755),
                           legacy_gids)
        dnamed = {group: owner_bits}
        if owner_uid != 0:
            dnamed[(ACL_USER, owner_uid)] = 7
        dnew = _keep_mask(default, _with_entries(default, dnamed))
        if dnew != default:
            os.setxattr(path, XATTR_DEFAULT, encode_acl(dnew))
            changed = True
    return changed


def is_granted(root: int | str, sandbox_gid: int) -> bool:
    """True when the workspace root (a pinned fd, or a path) already carries the
    group's access and default entries (the mark of a completed ``grant_tree``).
    One syscall pair, so it is checked on every call rather than cached by
    inode (inodes of deleted workspaces are reused)."""
    # The fd's magic link is followed to the pinned inode; a path is not followed.
    path, follow = (f"/proc/self/fd/{root}", True) if isinstance(root, int) else (root, False)
    try:
        access = decode_acl(os.getxattr(path, XATTR_ACCESS, follow_symlinks=follow))
        default = decode_acl(os.getxattr(path, XATTR_DEFAULT, follow_symlinks=follow))
    except (OSError, ValueError):
        return False
    key = (ACL_GROUP, sandbox_gid)
    return key in access and key in default


@dataclass
class GrantReport:
    entries: int = 0
    changed: int = 0
    skipped_links: int = 0
    complete: bool = True


def grant_tree(root: int | str, sandbox_gid: int,
               legacy_gids: tuple[int, ...] = ()) -> GrantReport:
    """Grant the workspace's group the tree under ``root`` (a pinned fd, or a
    path opened without following a symlink) -- see the module docstring. Blocking."""
    try:
        return _grant_tree(root, sandbox_gid, legacy_gids)
    except OSError as exc:
        hint = ("mount its filesystem with POSIX ACL support, or make the workspace "
                f"writable by group {sandbox_gid} yourself"
                if exc.errno in (errno.EOPNOTSUPP, errno.ENOTSUP)
                else "check that the worker runs as root and the filesystem is writable")
        raise WorkspaceUnusable(f"cannot grant workspace {root} to the sandbox user: "
                                f"{exc.strerror or exc}", hint=hint) from exc


def _grant_tree(root: int | str, sandbox_gid: int, legacy_gids: tuple[int, ...],
                ) -> GrantReport:
    report = GrantReport()
    root_fd = (os.dup(root) if isinstance(root, int) else
               os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC))
    try:
        owner = os.fstat(root_fd).st_uid
        stack = [os.dup(root_fd)]
        while stack:
            dfd = stack.pop()
            try:
                st = os.fstat(dfd)
                report.entries += 1
                report.changed += grant_entry(dfd, st, sandbox_gid, owner, legacy_gids)
                # O_PATH fds cannot list; reopen this very directory for reading.
                rfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dfd)
                try:
                    names = os.listdir(rfd)
                finally:
                    os.close(rfd)
                for name in names:
                    if report.entries >= MAX_ENTRIES:
                        report.complete = False
                        break
                    try:
                        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                    except OSError:
                        continue
                    cst = os.fstat(fd)
                    if stat.S_ISDIR(cst.st_mode):
                        stack.append(fd)
                        continue
                    try:
                        report.entries += 1
                        if stat.S_ISREG(cst.st_mode) and cst.st_nlink > 1:
                            report.skipped_links += 1
                        else:
                            report.changed += grant_entry(fd, cst, sandbox_gid, owner,
                                                          legacy_gids)
                    finally:
                        os.close(fd)
            finally:
                os.close(dfd)
    finally:
        os.close(root_fd)
    if not report.complete:
        log.warning("workspace %s has more than %d entries; granted only the first ones",
                    root, MAX_ENTRIES)
    return report


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
