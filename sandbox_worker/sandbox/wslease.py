"""Who uses a workspace now, across the workers of a host, and whether a grant is left on it.

A workspace's ACL grant (``acl.py``) is in force only while calls of it run:
each call grants, and the *last* call to finish revokes. Calls of one
workspace may overlap (parallel tool calls, sessions sharing a directory,
several workers), so each holds a shared ``flock`` on the workspace's use
file for its whole life, ``use-<dev>-<ino>`` in the root-only workspace-group
directory (``wsgroups.py``). At its end a call tries to convert that lock to
an exclusive one without waiting: only the call that gets it -- no other call
holds the file -- revokes, and while it does, new calls wait for their shared
lock (a grant never interleaves with a revoke). The kernel converts a lock
by dropping the old one and checking the others in one step, so of calls
ending together the last one always gets it.

The file also says whether a grant may be left: ``G`` and the workspace's
resolved path while one may be, ``C`` once a complete revoke ran. A worker
killed mid-call leaves ``G`` behind (its lock dies with it); the next worker
to start revokes every such workspace it can lock exclusively
(``WorkspacePins.recover``), and any later call of it revokes fully anyway.

Invariants:
- A revoke runs only under the exclusive lock: no call of the workspace is
  between its grant and its end, on any worker of this host.
- Files are bounded by the workspaces this host has run calls in (one small
  file each, like the group files), and never removed: an unlinked lock file
  would let two calls lock different files.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from typing import Final

GRANTED: Final = b"G"
CLEAN: Final = b"C"
PATH_MAX: Final = 4096
Identity = tuple[int, int]


def _name(directory: str, identity: Identity) -> str:
    return os.path.join(directory, f"use-{identity[0]}-{identity[1]}")


def acquire(directory: str, identity: Identity, path: str) -> int:
    """Hold the workspace's use file shared (waiting while a revoke runs) and
    mark it granted with ``path``. Returns the fd; the caller ends with
    ``finish``. Blocking."""
    fd = os.open(_name(directory, identity), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        record = GRANTED + path.encode("utf-8", "surrogateescape")[:PATH_MAX] + b"\n"
        # No ftruncate: a longer old path's tail after the newline is ignored.
        if os.pread(fd, len(record), 0) != record:
            os.pwrite(fd, record, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def try_exclusive(fd: int) -> bool:
    """Convert the shared hold to an exclusive one without waiting; False when
    another call holds the file (the hold is then gone: only close it)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def mark_clean(fd: int) -> None:
    """After a complete revoke, under the exclusive lock."""
    os.pwrite(fd, CLEAN, 0)


def left_granted(directory: str, limit: int) -> Iterator[tuple[int, Identity, str]]:
    """Use files marked granted that no call holds: (fd locked exclusively,
    identity, path), at most ``limit``. The consumer closes each fd."""
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith("use-"))
    except FileNotFoundError:
        return
    seen = 0
    for name in names:
        parts = name.split("-")
        if len(parts) != 3 or not (parts[1].isdigit() and parts[2].isdigit()):
            continue
        try:
            fd = os.open(os.path.join(directory, name), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        handed = False
        try:
            if os.pread(fd, 1, 0) != GRANTED:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live call holds it: its end revokes
            record = os.pread(fd, PATH_MAX + 2, 0)
            path = record[1:].split(b"\n", 1)[0].decode("utf-8", "surrogateescape")
            seen += 1
            handed = True
            yield fd, (int(parts[1]), int(parts[2])), path
        finally:
            if not handed:
                os.close(fd)
        if seen >= limit:
            return
