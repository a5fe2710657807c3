"""Reaping the pid-namespace inits that bwrap leaves behind.

With ``--unshare-pid``, bwrap's outer (monitor) process learns the command's
exit status through an eventfd and exits at once, before its child -- the
namespace's init -- has been reaped. That init is re-parented to the nearest
subreaper, by default the host's pid 1. A pid 1 that reaps lazily (as in
containers and micro-VMs) then holds one zombie per call for seconds, and
those zombies count against the sandbox uid's RLIMIT_NPROC: under load,
new calls fail with "Creating new namespace failed: Resource temporarily
unavailable" (measured here with 32 calls in flight).

So the worker makes itself a child subreaper and, on SIGCHLD, reaps the
zombies among its children that are bwrap namespace inits and not chain
heads it started itself (those are awaited by asyncio).

Invariants:
- Only zombies named ``bwrap`` that are not in ``MANAGED_HEADS`` are reaped,
  by pid with WNOHANG: no other child's exit status is ever stolen.
- Chain heads are added to ``MANAGED_HEADS`` before control returns to the
  event loop after spawning, and removed after asyncio reaped them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
from typing import Final

log = logging.getLogger(__name__)

PR_SET_CHILD_SUBREAPER: Final = 36
MANAGED_HEADS: set[int] = set()


def _children() -> list[int]:
    pids: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/children") as f:
                pids.extend(int(p) for p in f.read().split())
    return pids


def _zombie_bwrap(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    comm = stat[stat.find(b"(") + 1: stat.rfind(b")")]
    state = stat[stat.rfind(b")") + 2: stat.rfind(b")") + 3]
    return comm == b"bwrap" and state == b"Z"


class OrphanReaper:
    """Subreaper + SIGCHLD sweep for orphaned bwrap namespace inits."""

    def __init__(self) -> None:
        self.reaped = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def install(self) -> bool:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            log.warning("cannot become a child subreaper: %s",
                        os.strerror(ctypes.get_errno()))
            return False
        self._loop = asyncio.get_running_loop()
        self._loop.add_signal_handler(signal.SIGCHLD, self.sweep)
        self.sweep()
        return True

    def sweep(self) -> None:
        for pid in _children():
            if pid in MANAGED_HEADS or not _zombie_bwrap(pid):
                continue
            with contextlib.suppress(ChildProcessError):
                got, _ = os.waitpid(pid, os.WNOHANG)
                if got == pid:
                    self.reaped += 1

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_signal_handler(signal.SIGCHLD)
            self.sweep()
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        self._loop = None
