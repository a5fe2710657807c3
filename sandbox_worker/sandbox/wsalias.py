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

Who uses an alias is counted by the kernel: every call that goes through it
holds ``ALIAS_ROOT/<gid>/users`` (0600 root) with a shared ``flock`` from
before it looks at the mount until its end (``Alias.lock_fd``), whichever
worker of the host runs it. At its end a call tries to convert that lock to
an exclusive one without waiting (as ``wslease.py`` does for the grant): only
the last call gets it, and it detaches the alias (``release``). A worker
killed mid-call holds nothing any more (its locks die with it), so the
aliases it left are detached by the next ``sweep`` that finds them unused:
at every worker's start and graceful stop.

Invariants:
- The alias is mounted from the pinned fd (``/proc/self/fd/N``: no path is
  resolved) and is used only when its ``(st_dev, st_ino)`` equals the pinned
  identity; a stale mount there (the gid's previous identity) is detached
  first.
- Nothing but the workspace's group can traverse ``ALIAS_ROOT/<gid>``.
- An alias is mounted and detached only under its ``users`` lock: mounted
  (or found) under a shared hold, detached under the exclusive one, so a
  call never finds its alias gone while it runs, on any worker of the host.
- One mount at most per alias: holders of the shared lock look and mount one
  at a time, under an exclusive ``flock`` of ``MOUNTING`` beside it (two
  calls starting together on two workers each found no mount under their
  shared holds and mounted twice; the last call's detach then lifted only the
  top one and the other stayed until the next sweep). Detaching lifts every
  layer found there, so a stack an older worker left goes too.
- No alias outlives the last call through it (``release``), except those of
  workers killed mid-call, until the next worker start or stop (``sweep``):
  a removed workspace is not kept alive by a mount. (An alias an older
  worker mounted, without a ``users`` file, is detached once its workspace
  is deleted, as before.)
- Mounts are detached lazily (``MNT_DETACH``): an fd still open through one
  (the ending call's own) does not keep it in the mount table.
- ``users`` files are never removed (an unlinked lock file would let two
  calls lock different files): one per gid, bounded like the gids.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
from dataclasses import dataclass
from typing import Final

from sandbox_worker.sandbox.errors import WorkspaceUnusable

ALIAS_ROOT: Final = "/run/corral/workspaces"
USERS: Final = "users"  # the lock file of an alias's calls, beside its mount point
MOUNTING: Final = "mounting"  # held exclusively while a call looks for, or makes, the mount
MAX_LAYERS: Final = 16  # mounts stacked on one alias that a detach lifts at most
MS_BIND: Final = 4096
MNT_DETACH: Final = 2

_libc = ctypes.CDLL(None, use_errno=True)


def _mount_points() -> set[str]:
    """The mount points of this mount namespace (from mountinfo:
    ``os.path.ismount`` looks up ``..``, which a deleted directory mounted
    there no longer has)."""
    try:
        with open("/proc/self/mountinfo") as f:
            return {line.split()[4] for line in f}
    except OSError:
        return set()


def _is_mount(path: str) -> bool:
    return path in _mount_points()


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


@dataclass
class Alias:
    """One call's way in: the mounted path and its shared hold on ``users``."""

    path: str
    identity: tuple[int, int]
    lock_fd: int


def _open_lock(base: str, name: str) -> int:
    return os.open(f"{base}/{name}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                   0o600)


def _detach(target: str) -> bool:
    """Lift every mount stacked on ``target`` (at most ``MAX_LAYERS``);
    whether one was."""
    lifted = 0
    while lifted < MAX_LAYERS and _libc.umount2(target.encode(), MNT_DETACH) == 0:
        lifted += 1
    return lifted > 0


def alias_for(fd: int, gid: int, identity: tuple[int, int]) -> Alias:
    """The alias of the pinned workspace ``fd`` for calls of group ``gid``
    (mounted on first use), held shared until ``release``. Blocking (waits
    while the last call of an earlier use, or a sweep, detaches it); raises
    ``WorkspaceUnusable``."""
    try:
        os.makedirs(os.path.dirname(ALIAS_ROOT), mode=0o755, exist_ok=True)
        _dir(ALIAS_ROOT, 0o711, 0)
        base = f"{ALIAS_ROOT}/{gid}"
        _dir(base, 0o710, gid)
        lock_fd = _open_lock(base, USERS)
    except OSError as exc:
        raise WorkspaceUnusable(f"cannot prepare {ALIAS_ROOT}: {exc.strerror}",
                                hint="run the worker as root") from exc
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_SH)
        try:
            mounting = _open_lock(base, MOUNTING)
        except OSError as exc:
            raise WorkspaceUnusable(f"cannot prepare {base}: {exc.strerror}",
                                    hint="run the worker as root") from exc
        try:
            fcntl.flock(mounting, fcntl.LOCK_EX)  # one caller looks and mounts at a time
            return Alias(_mount(fd, base, identity), identity, lock_fd)
        finally:
            os.close(mounting)
    except BaseException:
        os.close(lock_fd)
        raise


def _mount(fd: int, base: str, identity: tuple[int, int]) -> str:
    target = f"{base}/ws"
    try:
        if not _is_mount(target):
            _dir(target, 0o700, 0)  # the mount point (hidden by the mount)
    except OSError as exc:
        raise WorkspaceUnusable(f"cannot prepare {target}: {exc.strerror}",
                                hint="run the worker as root") from exc
    seen = _identity(target)
    if seen == identity:
        return target
    if seen is not None and _is_mount(target):
        _detach(target)  # stale: the gid's old workspace
    if _libc.mount(f"/proc/self/fd/{fd}".encode(), target.encode(), None, MS_BIND,
                   None) != 0:
        err = ctypes.get_errno()
        raise WorkspaceUnusable(f"cannot mount the workspace at {target}: "
                                f"{os.strerror(err or errno.EPERM)}",
                                hint="make its parent directories searchable (chmod o+x) or "
                                "run the worker where it may mount")
    if _identity(target) != identity:
        _detach(target)
        raise WorkspaceUnusable(f"the workspace mounted at {target} is not the pinned one")
    return target


def release(alias: Alias) -> bool:
    """End one call's use of ``alias``: the last call through it (the one
    that gets the exclusive lock) detaches it. Closes the hold; idempotent.
    Blocking; returns whether it detached the alias."""
    if alias.lock_fd < 0:
        return False
    try:
        try:
            fcntl.flock(alias.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # another call still goes through it: its end detaches
        # Another workspace may hold the gid now (it detached ours as stale).
        return _identity(alias.path) == alias.identity and _detach(alias.path)
    finally:
        os.close(alias.lock_fd)
        alias.lock_fd = -1


def sweep() -> int:
    """Detach every alias no call holds: those workers killed mid-call left,
    and those of deleted workspaces (a host then keeps no mount, nor a deleted
    tree's disk space, per workspace it ever served). An alias without a
    ``users`` file was mounted by a worker of an older version, which holds
    no lock: it is detached only once its workspace is deleted. Run at
    worker start and stop. Blocking; returns how many were detached."""
    detached = 0
    try:
        names = os.listdir(ALIAS_ROOT)
    except OSError:
        return 0
    mounted = _mount_points()
    for name in names:
        base = f"{ALIAS_ROOT}/{name}"
        target = f"{base}/ws"
        if not name.isdigit() or target not in mounted:
            continue
        try:
            lock_fd = os.open(f"{base}/{USERS}", os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            if _deleted(target) and _detach(target):
                detached += 1
            continue
        except OSError:
            continue
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _detach(target):
                detached += 1
        except BlockingIOError:
            continue  # a live call holds it: its end detaches
        finally:
            os.close(lock_fd)
    return detached


def _deleted(target: str) -> bool:
    try:
        return os.stat(target).st_nlink == 0
    except OSError:
        return False
