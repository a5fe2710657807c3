"""A way in for a workspace whose parents the sandbox cannot search.

A workspace under a directory others cannot search (``/root/proj`` with
``/root`` 0700) is usable by the file tools (they work on the worker's
root-opened fd), but bwrap 0.8's ``--bind-fd`` reads the fd's path back and
mounts it as the call's uid, and the T1 launcher opens the workspace by
path: both need every parent to be searchable. Loosening the parent would
open it to every local user. Instead the worker (root) bind-mounts the
pinned workspace at ``ALIAS_ROOT/<gid>/ws``, where ``ALIAS_ROOT`` is 0711
root and ``ALIAS_ROOT/<gid>`` is 0710 ``root:<gid>``: only processes with
the workspace's own group -- its calls -- can pass, and they reach exactly
the directory they were granted anyway. The parent keeps its mode.

Invariants:
- The alias is mounted from the pinned fd (``/proc/self/fd/N``: no path is
  resolved) and is used only when its ``(st_dev, st_ino)`` equals the pinned
  identity; a stale mount there (the gid's previous identity) is detached
  first.
- Nothing but the workspace's group can traverse ``ALIAS_ROOT/<gid>``.
- Mounts stay until the host reboots (``/run`` is a tmpfs), a later call
  finds them stale, or a worker starting finds their workspace deleted
  (``prune``): one per live workspace that needs one.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
from typing import Final

from sandbox_worker.sandbox.errors import WorkspaceUnusable

ALIAS_ROOT: Final = "/run/corral/workspaces"
MS_BIND: Final = 4096
MNT_DETACH: Final = 2

_libc = ctypes.CDLL(None, use_errno=True)


def _is_mount(path: str) -> bool:
    """Whether ``path`` is a mount point in this mount namespace (from
    mountinfo: ``os.path.ismount`` looks up ``..``, which a deleted directory
    mounted there no longer has)."""
    try:
        with open("/proc/self/mountinfo") as f:
            return any(line.split()[4] == path for line in f)
    except OSError:
        return False


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _dir(path: str, mode: int, gid: int) -> None:
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, mode)
    st = os.lstat(path)
    if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != 0:
        raise WorkspaceUnusable(f"{path} is not a root-owned directory; refusing to use it")
    os.chown(path, 0, gid, follow_symlinks=False)
    os.chmod(path, mode)


def alias_for(fd: int, gid: int, identity: tuple[int, int]) -> str:
    """The alias path of the pinned workspace ``fd`` for calls of group ``gid``
    (mounted on first use). Blocking; raises ``WorkspaceUnusable``."""
    try:
        os.makedirs(os.path.dirname(ALIAS_ROOT), mode=0o755, exist_ok=True)
        _dir(ALIAS_ROOT, 0o711, 0)
        base = f"{ALIAS_ROOT}/{gid}"
        _dir(base, 0o710, gid)
        target = f"{base}/ws"
        if not _is_mount(target):
            _dir(target, 0o700, 0)  # the mount point (hidden by the mount)
    except OSError as exc:
        raise WorkspaceUnusable(f"cannot prepare {ALIAS_ROOT}: {exc.strerror}",
                                hint="run the worker as root") from exc
    seen = _identity(target)
    if seen == identity:
        return target
    if seen is not None and _is_mount(target):
        _libc.umount2(target.encode(), MNT_DETACH)  # stale: the gid's old workspace
    if _libc.mount(f"/proc/self/fd/{fd}".encode(), target.encode(), None, MS_BIND,
                   None) != 0:
        err = ctypes.get_errno()
        raise WorkspaceUnusable(f"cannot mount the workspace at {target}: "
                                f"{os.strerror(err or errno.EPERM)}",
                                hint="make its parent directories searchable (chmod o+x) or "
                                "run the worker where it may mount")
    if _identity(target) != identity:
        _libc.umount2(target.encode(), MNT_DETACH)
        raise WorkspaceUnusable(f"the workspace mounted at {target} is not the pinned one")
    return target


def prune() -> int:
    """Detach the aliases of workspaces that were deleted (their mounted
    directory has no links left), so a host does not keep a mount -- and the
    deleted tree's disk space -- per workspace it ever served. Run at worker
    start. Blocking; returns how many were detached."""
    detached = 0
    try:
        names = os.listdir(ALIAS_ROOT)
    except OSError:
        return 0
    for name in names:
        target = f"{ALIAS_ROOT}/{name}/ws"
        try:
            if not _is_mount(target) or os.stat(target).st_nlink > 0:
                continue
        except OSError:
            continue
        if _libc.umount2(target.encode(), MNT_DETACH) == 0:
            detached += 1
    return detached
