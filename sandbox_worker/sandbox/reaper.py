"""Reaping (and killing) what a call leaves re-parented to the worker.

With ``--unshare-pid``, bwrap's outer (monitor) process learns the command's
exit status through an eventfd and exits at once, before its child -- the
namespace's init -- has been reaped. That init is re-parented to the nearest
subreaper, by default the host's pid 1. A pid 1 that reaps lazily (as in
containers and micro-VMs) then holds one zombie per call for seconds, and
those zombies count against the call uid's RLIMIT_NPROC (and keep that uid
in the pool's quarantine, ``uidpool.py``): under load, new
calls failed with "Creating new namespace failed: Resource temporarily
unavailable" (measured here with 32 calls in flight). Rarely, a bwrap helper
whose fork failed is left sleeping outside any namespace.

So the tool service makes the worker a child subreaper (``install``) and, on
every SIGCHLD, sweeps its children: a child running as a uid of the per-call
range that is not a chain head being awaited is a remnant of a finished call -- a zombie
is reaped by pid, a live one is SIGKILLed (and reaped on the next SIGCHLD).

Invariants:
- Chain heads are spawned inside ``spawning()`` and registered in
  ``MANAGED_HEADS`` before it exits; no sweep runs while a spawn is in
  progress (a missed sweep runs right after), so a head is never reaped or
  killed here and asyncio always gets its exit status.
- Only children whose real uid lies in the per-call uid range are touched;
  chain heads start as root (the uid drop is their second link).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
from collections.abc import Iterator
from typing import Final

from broker import plants  # chaos plant switches

log = logging.getLogger(__name__)

PR_SET_CHILD_SUBREAPER: Final = 36
MANAGED_HEADS: set[int] = set()
_state = {"spawning": 0, "missed": 0}
_active: list[OrphanReaper] = []


@contextlib.contextmanager
def spawning() -> Iterator[None]:
    """Hold sweeps while a chain head is being spawned and registered."""
    _state["spawning"] += 1
    try:
        yield
    finally:
        _state["spawning"] -= 1
        if _state["spawning"] == 0 and _state["missed"]:
            _state["missed"] = 0
            for reaper in _active:
                reaper.sweep()


def _children() -> list[int]:
    pids: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/children") as f:
                pids.extend(int(p) for p in f.read().split())
    return pids


def _status(pid: int) -> tuple[bool, int] | None:
    """(is_zombie, real uid) of a child, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    zombie, uid = False, -1
    for line in lines:
        if line.startswith("State:"):
            zombie = "Z" in line.split()[1]
        elif line.startswith("Uid:"):
            uid = int(line.split()[1])
    return zombie, uid


class OrphanReaper:
    """Subreaper + SIGCHLD sweep for remnants of finished calls."""

    def __init__(self, uids: range) -> None:
        self.uids = uids
        self.reaped = 0
        self.killed = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def install(self) -> bool:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            log.warning("cannot become a child subreaper: %s",
                        os.strerror(ctypes.get_errno()))
            return False
        self._loop = asyncio.get_running_loop()
        self._loop.add_signal_handler(signal.SIGCHLD, self.sweep)
        _active.append(self)
        self.sweep()
        return True

    def sweep(self) -> None:
        if _state["spawning"]:
            _state["missed"] = 1
            return
        for pid in _children():
            if pid in MANAGED_HEADS:
                continue
            st = _status(pid)
            if st is None or st[1] not in self.uids:
                continue
            if st[0]:
                with contextlib.suppress(ChildProcessError):
                    if os.waitpid(pid, os.WNOHANG)[0] == pid:
                        self.reaped += 1
            elif not plants.on("no_tree_kill"):  # chaos plant: remnants left running
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    self.killed += 1

    def close(self) -> None:
        if self in _active:
            _active.remove(self)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_signal_handler(signal.SIGCHLD)
            self.sweep()
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        self._loop = None
