"""What the workspace walks (the grant, the release, the sweep) hold while they run.

A walk keeps the directories it has still to visit on a stack. Holding an
``O_PATH`` fd for each of them let one hostile call exhaust the worker's
file descriptors: a directory of 20,000 subdirectories (made in a second)
had the next walk hold 20,000 fds, and every other call of the worker, on any
workspace, failed with "Too many open files" meanwhile. Reading a whole
directory before looking at the entry bound let a call make the worker hold
every name of a directory of millions of entries (1,000,000 hard links with
long names: 419 MiB of the worker's memory). So:

- a directory still to visit keeps its fd only while the stack holds fewer
  than ``HELD_FDS_MAX`` of them; past that it is kept by its path relative
  to the walk's root and reopened beneath the root when its turn comes
  (``reopen``: ``openat2`` with no ``..``, no symlink, no magic link), so a
  walk never holds more than ``HELD_FDS_MAX`` + 2 fds;
- a directory is read lazily (``entries``), so the walk reads no further
  than its entry bound.

A directory replaced between being seen and being reopened is walked as it
is then, still beneath the root, or skipped (``None``) if it is gone or no
longer a directory -- as a directory replaced before the walk reached it
always was.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Final

from sandbox_worker.sandbox.resolve import openat2

HELD_FDS_MAX: Final = 256


def keep(fd: int, waiting: int) -> int:
    """The fd to keep for a directory to visit when ``waiting`` are already
    on the stack: ``fd`` itself, or -1 (closed; ``reopen`` it later)."""
    if waiting < HELD_FDS_MAX:
        return fd
    os.close(fd)
    return -1


def reopen(root_fd: int, fd: int, rel: str) -> int | None:
    """``fd`` if it is held, else the directory ``rel`` (relative to the walk's
    root, ``/``-terminated) opened ``O_PATH`` beneath ``root_fd``; None when
    it is gone or no longer a directory."""
    if fd >= 0:
        return fd
    try:
        return openat2(root_fd, rel.rstrip("/") or ".",
                       os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None


def entries(dfd: int) -> Iterator[os.DirEntry[str]]:
    """The entries of the directory ``dfd`` (an ``O_PATH`` fd), read lazily."""
    rfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dfd)
    try:
        with os.scandir(rfd) as it:
            yield from it
    finally:
        os.close(rfd)
