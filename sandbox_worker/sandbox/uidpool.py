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
Each worker starts its search at its own offset (from its pid) and walks the
range with a rotating cursor, so workers rarely contend and a released uid
is not reused at once.

A uid is handed out only after its lock is held *and* a scan of
``/proc/*/status`` shows no process (alive or zombie) whose real, effective,
saved or filesystem uid is that uid. The scan runs after locking: nothing but
a lock holder (or a process already seen) can create a process of the uid.
A released uid whose processes are not all gone (a zombie not yet reaped, a
leftover) stays locked in quarantine and is re-checked on each later
acquire or release; it is unlocked only once nothing of it remains.

Invariants:
- Two workers never hold the same uid at once (flock on the same file).
- A uid is never handed out while any process of that uid exists.
- Uids of the range are never 0, never a passwd user's uid and never inside
  an ``/etc/subuid`` delegation (checked at ``setup``; refused loudly).
- Lock files are bounded by the range size (one empty file per uid used).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import pwd
import threading
import time
from dataclasses import dataclass
from typing import Final

from sandbox_worker.sandbox.errors import SandboxSetupError, UidPoolExhausted

log = logging.getLogger(__name__)

DEFAULT_UID_START: Final = 200_000
DEFAULT_UID_COUNT: Final = 65_536
DEFAULT_LOCK_DIR: Final = "/run/corral/uids"
UID_MAX: Final = 2**31 - 2  # stay clear of (uid_t)-1 and of signed-int tools
POOL_WAIT_STEP_S: Final = 0.1


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
    zombies included. Blocking; about 1.6 ms for 150 processes here."""
    found: set[int] = set()
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                data = f.read()
        except OSError:
            continue  # exited meanwhile
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


def _subuid_ranges(path: str = "/etc/subuid") -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    with contextlib.suppress(OSError), open(path) as f:
        for line in f:
            parts = line.strip().split(":")
            if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
                out.append((int(parts[1]), int(parts[2])))
    return out


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
        self.acquired = 0
        self.skipped_in_use = 0

    def setup(self, *, reserved_uids: tuple[int, ...] = ()) -> None:
        """Check the range and create the lock directory. Blocking."""
        if self.start <= 0 or self.count <= 0 or self.start + self.count - 1 > UID_MAX:
            raise SandboxSetupError(f"sandbox uid range {self.start}:{self.count} is invalid",
                                    hint=f"use START:COUNT within 1..{UID_MAX}")
        clash = [u for u in reserved_uids if u in self.uids]
        clash += [p.pw_uid for p in pwd.getpwall() if p.pw_uid in self.uids]
        if clash:
            raise SandboxSetupError(
                f"sandbox uid range {self.start}:{self.count} contains uid {clash[0]}, "
                "which belongs to a user (or to the file tools)",
                hint="choose a range with no passwd entries: --sandbox-uid-range START:COUNT")
        for lo, n in _subuid_ranges():
            if lo < self.start + self.count and self.start < lo + n:
                raise SandboxSetupError(
                    f"sandbox uid range {self.start}:{self.count} overlaps the subordinate "
                    f"uid range {lo}:{n} of /etc/subuid (a user's containers)",
                    hint="choose a disjoint range: --sandbox-uid-range START:COUNT")
        try:
            os.makedirs(self.lock_dir, mode=0o700, exist_ok=True)
            st = os.stat(self.lock_dir)
        except OSError as exc:
            raise SandboxSetupError(f"cannot create the uid lock directory {self.lock_dir}: "
                                    f"{exc.strerror}",
                                    hint="run the worker as root") from exc
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise SandboxSetupError(
                f"uid lock directory {self.lock_dir} must be owned by the worker's user and "
                "not group/other-writable", hint=f"chmod 700 {self.lock_dir}")

    # -- allocation ---------------------------------------------------------
    def try_acquire(self) -> UidLease | None:
        """Lock a free uid with no process, or None if there is none now. Blocking."""
        with self._lock:
            self._drain_quarantine()
            present: set[int] | None = None
            for _ in range(self.count):
                uid = self.start + self._cursor
                self._cursor = (self._cursor + 1) % self.count
                if uid in self._held or uid in self._quarantine:
                    continue
                fd = self._lock_file(uid)
                if fd is None:
                    continue  # another worker holds it
                # Scan after locking (see the module doc); one scan per acquire
                # normally suffices, rescan if a candidate had to be skipped.
                present = uids_present(self.start, self.start + self.count)
                if uid in present:
                    os.close(fd)
                    self.skipped_in_use += 1
                    continue
                lease = UidLease(uid, self.gid, fd)
                self._held[uid] = lease
                self.acquired += 1
                return lease
            return None

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

    def release(self, lease: UidLease) -> int:
        """Give a uid back once the call is over. It is unlocked at once if no
        process of it remains, else kept locked in quarantine until none does.
        Returns how many uids were unlocked. Blocking (use ``give_back`` in
        the event loop)."""
        with self._lock:
            if self._held.pop(lease.uid, None) is None:
                return 0
            self._quarantine[lease.uid] = lease
            return self._drain_quarantine()

    async def give_back(self, lease: UidLease) -> None:
        """``release`` off the event loop; wakes calls waiting for a uid."""
        if await asyncio.to_thread(self.release, lease):
            self._freed.set()

    def _drain_quarantine(self) -> int:
        if not self._quarantine:
            return 0
        present = uids_present(self.start, self.start + self.count)
        freed = 0
        for uid in [u for u in self._quarantine if u not in present]:
            os.close(self._quarantine.pop(uid).fd)
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
                "skipped_in_use": self.skipped_in_use}
