"""Per-call sandbox uids: each running shell call gets its own non-root uid.

RLIMIT_NPROC is counted per *real uid* across the whole host. With one shared
sandbox uid, one call's fork bomb (contained at its own NPROC limit) made every
other call on the host -- other sessions, other workers -- fail to fork or even
to start bwrap until the bomb was killed. So each call runs as a uid of its
own, taken from a configured range (``--sandbox-uid-range START:COUNT``,
default ``200000:65536``; no passwd entries are needed), with the shared
sandbox group as its gid. Its process limit is then really per call.

Allocation across workers on one host uses one lock file per uid in a shared,
root-only directory (default ``/run/corral/uids``) and ``flock(LOCK_EX |
LOCK_NB)`` on it. A flock belongs to an open file description, so the kernel
drops it when the holder dies -- a SIGKILLed worker never leaks a uid lock.
A worker first reuses the uids it gave back clean (oldest first, once eight
others were given back after it; no scan needed), then walks the range from
its own offset (from its pid) with a rotating cursor, so workers rarely
contend for the same lock files.

A uid is handed out only after its lock is held *and* either its lock file
says ``clean`` -- written by its last holder when it gave the uid back after
the call's whole tree was killed and reaped (``process.run``'s guarantee) --
or a scan of ``/proc/*/status`` (taken after locking) shows no process, alive
or zombie, whose real, effective, saved or filesystem uid is that uid. A new
lock file, or one still naming a holder (a worker that died holding it),
always gets the scan: its call's processes may outlive it. Scanning after
locking closes the race: nothing but a lock holder, or a process already
seen, can create a process of the uid. A uid released without that
guarantee (``release()``) whose processes are not all gone stays locked in
quarantine and is re-checked on later scans; it is unlocked only once
nothing of it remains.

Invariants:
- Two workers never hold the same uid at once (flock on the same file).
- A uid is never handed out while any process of that uid exists, provided
  only Corral workers create processes of the range (it is reserved: no
  passwd entries, no subuid delegations).
- Uids of the range are never 0, never a passwd user's uid and never inside
  an ``/etc/subuid`` delegation (checked at ``setup``; refused loudly).
- Lock files are bounded by the range size (one empty file per uid used).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import fcntl
import functools
import itertools
import logging
import os
import pwd
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

from sandbox_worker.sandbox.errors import UidPoolExhausted
from sandbox_worker.sandbox.ranges import ID_MAX, RangeKind, check_range, private_dir

log = logging.getLogger(__name__)

DEFAULT_UID_START: Final = 200_000
DEFAULT_UID_COUNT: Final = 65_536
DEFAULT_LOCK_DIR: Final = "/run/corral/uids"
UID_MAX: Final = ID_MAX
UID_KIND: Final = RangeKind("sandbox uid range", "uid", "a user (or to the file tools)",
                            "passwd entries", "/etc/subuid", "--sandbox-uid-range")
POOL_WAIT_STEP_S: Final = 0.1
RECENT_MAX: Final = 4096  # clean uids remembered for reuse without a scan
# A clean uid rests until this many others were given back: consecutive calls
# get different uids, and bwrap's orphaned init is reaped long before reuse.
REUSE_AFTER: Final = 8
MARK_BYTES: Final = 24  # fixed-size lock file records: no ftruncate (slow here)
CLEAN: Final = b"clean".ljust(MARK_BYTES)  # the last holder's call tree was gone


def _mark(fd: int, content: bytes) -> None:
    os.pwrite(fd, content[:MARK_BYTES].ljust(MARK_BYTES), 0)


def parse_range(text: str) -> tuple[int, int]:
    """``START:COUNT`` -> (start, count); raises ValueError with a clear message."""
    start_s, sep, count_s = text.partition(":")
    if not sep or not start_s.strip().isdigit() or not count_s.strip().isdigit():
        raise ValueError(f"uid range must be START:COUNT, got {text!r}")
    start, count = int(start_s), int(count_s)
    if start <= 0 or count <= 0 or start + count - 1 > UID_MAX:
        raise ValueError(f"uid range {text!r} must lie within 1..{UID_MAX} and be non-empty")
    return start, count


def uids_present(lo: int, hi: int) -> set[int]:
    """Uids in ``[lo, hi)`` held (real/effective/saved/fs) by any process,
    zombies included. Blocking; 1-2 ms for 150 processes on an idle 2-vCPU
    machine, ten times that under heavy load."""
    found: set[int] = set()
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit():
            continue
        try:
            fd = os.open(f"/proc/{name}/status", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue  # exited meanwhile
        try:
            data = os.read(fd, 2048)  # "Uid:" is within the first ~400 bytes
        except OSError:
            continue
        finally:
            os.close(fd)
        at = data.find(b"\nUid:")
        if at < 0:
            continue
        end = data.find(b"\n", at + 1)
        for field in data[at + 5:end].split():
            with contextlib.suppress(ValueError):
                uid = int(field)
                if lo <= uid < hi:
                    found.add(uid)
    return found


@dataclass(frozen=True)
class UidLease:
    """One uid held for one call; give it back with ``UidPool.release``."""

    uid: int
    gid: int
    fd: int  # the locked file; closing it drops the flock


class UidPool:
    """Hands out per-call uids from ``[start, start + count)`` (see module doc)."""

    def __init__(self, start: int, count: int, gid: int, lock_dir: str = DEFAULT_LOCK_DIR,
                 ) -> None:
        self.start = start
        self.count = count
        self.gid = gid
        self.lock_dir = lock_dir
        self.uids = range(start, start + count)
        self._lock = threading.Lock()
        self._held: dict[int, UidLease] = {}
        self._quarantine: dict[int, UidLease] = {}
        # Each worker walks from its own offset (Knuth's multiplicative hash).
        self._cursor = (os.getpid() * 2654435761) % count
        self._freed = asyncio.Event()
        self._recent: collections.deque[int] = collections.deque(maxlen=RECENT_MAX)
        self.acquired = 0
        self.skipped_in_use = 0
        self.scans = 0

    def setup(self, *, reserved_uids: tuple[int, ...] = ()) -> None:
        """Check the range and create the lock directory. Blocking."""
        check_range(UID_KIND, self.start, self.count, (p.pw_uid for p in pwd.getpwall()),
                    reserved_uids)
        private_dir(self.lock_dir, "uid lock directory")

    # -- allocation ---------------------------------------------------------
    def try_acquire(self) -> UidLease | None:
        """Lock a free uid with no process, or None if there is none now. Blocking.

        A uid whose lock file says ``clean`` (its last holder gave it back
        after the call's tree was gone) is handed out without a scan; any
        other (new file, or a dead holder's pid) only after a ``/proc`` scan
        taken once it is locked.
        """
        with self._lock:
            lease = self._try_acquire()
            # Every uid was held or quarantined: a scan may free quarantined
            # ones; then try once more.
            if lease is None and self._quarantine and self._drain_quarantine(self._scan()):
                lease = self._try_acquire()
            return lease

    def _scan(self) -> set[int]:
        self.scans += 1
        return uids_present(self.start, self.start + self.count)

    def _try_acquire(self) -> UidLease | None:
        present: set[int] = set()
        # Uids this worker gave back clean first (no scan needed), oldest
        # first, each after REUSE_AFTER others were given back; then the
        # range from the cursor.
        ready = max(0, len(self._recent) - REUSE_AFTER)
        recent = [self._recent.popleft() for _ in range(ready)]
        for uid in itertools.chain(recent, self._walk()):
            if uid in self._held or uid in self._quarantine or uid in present:
                continue  # ours, or in use at this acquire's last scan
            fd = self._lock_file(uid)
            if fd is None:
                continue  # another worker holds it
            if os.pread(fd, len(CLEAN), 0) != CLEAN:
                # Never used, or its holder died holding it: scan after
                # locking (see the module doc).
                present = self._scan()
                self._drain_quarantine(present)
                if uid in present:
                    os.close(fd)
                    self.skipped_in_use += 1
                    continue
            _mark(fd, f"held by pid {os.getpid()}".encode())
            lease = UidLease(uid, self.gid, fd)
            self._held[uid] = lease
            self.acquired += 1
            return lease
        return None

    def _walk(self) -> Iterator[int]:
        for _ in range(self.count):
            uid = self.start + self._cursor
            self._cursor = (self._cursor + 1) % self.count
            yield uid

    async def acquire(self, timeout_s: float) -> UidLease:
        """A uid for one call, waiting up to ``timeout_s`` for one to free up."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._freed.clear()
            lease = await asyncio.to_thread(self.try_acquire)
            if lease is not None:
                return lease
            left = deadline - time.monotonic()
            if left <= 0:
                raise UidPoolExhausted(
                    f"all {self.count} sandbox uids ({self.start}..{self.start + self.count - 1})"
                    " are in use by running calls or their leftover processes; retry later or "
                    "widen --sandbox-uid-range")
            # Woken by our own releases; uids freed by other workers or by
            # leftovers dying are noticed at the next step.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, POOL_WAIT_STEP_S)):
                    await self._freed.wait()

    def release(self, lease: UidLease, *, tree_gone: bool = False) -> int:
        """Give a uid back. With ``tree_gone`` (the caller knows every process
        of the call has been killed and reaped: ``process.run`` returned) it
        is marked clean and unlocked at once. Otherwise a ``/proc`` scan
        decides: unlocked if nothing of it remains, else kept locked in the
        quarantine until a later scan shows nothing. Returns how many uids
        were unlocked."""
        with self._lock:
            if self._held.pop(lease.uid, None) is None:
                return 0
            if tree_gone:
                _mark(lease.fd, CLEAN)
                os.close(lease.fd)
                self._recent.append(lease.uid)
                return 1
            self._quarantine[lease.uid] = lease
            return self._drain_quarantine(self._scan())

    async def give_back(self, lease: UidLease) -> None:
        """Return a call's uid once its tree is gone (``release(tree_gone=True)``,
        off the event loop); wakes calls waiting for a uid."""
        await asyncio.to_thread(functools.partial(self.release, lease, tree_gone=True))
        self._freed.set()

    def _drain_quarantine(self, present: set[int]) -> int:
        freed = 0
        for uid in [u for u in self._quarantine if u not in present]:
            fd = self._quarantine.pop(uid).fd
            _mark(fd, CLEAN)
            os.close(fd)
            freed += 1
        return freed

    def _lock_file(self, uid: int) -> int | None:
        path = f"{self.lock_dir}/{uid}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return None
            raise
        return fd

    # -- introspection and shutdown -------------------------------------------
    def held(self) -> list[int]:
        with self._lock:
            return sorted(self._held)

    def quarantined(self) -> list[int]:
        with self._lock:
            return sorted(self._quarantine)

    def close(self) -> None:
        """Drop every lock (calls are over). Quarantined uids are dropped too:
        the next holder's scan still refuses them while anything of them lives."""
        with self._lock:
            for lease in [*self._held.values(), *self._quarantine.values()]:
                with contextlib.suppress(OSError):
                    os.close(lease.fd)
            self._held.clear()
            self._quarantine.clear()

    def info(self) -> dict[str, object]:
        return {"start": self.start, "count": self.count, "gid": self.gid,
                "lock_dir": self.lock_dir, "held": len(self._held),
                "quarantined": len(self._quarantine), "acquired": self.acquired,
                "skipped_in_use": self.skipped_in_use, "scans": self.scans}
