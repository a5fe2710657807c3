"""Firing one scheduled fault at a real target in the running farm.

Worker faults are aimed by state, not at random: the broker's STATUS lists,
per worker, the services of the requests it holds (``in_flight_services``);
``worker_kill_model`` picks a worker streaming a model answer,
``worker_kill_tool`` one running a tool, ``worker_kill_idle`` one holding
nothing, ``worker_hang`` one holding anything. The worker is matched to the
farm's child by the pid in its READY info. If no worker is in the wanted state
the injector polls STATUS for at most ``wait_s``; if still none, the fault is
recorded as skipped (with why), never as injected.

For a worker kill or hang, the calls the worker's cgroup holds at that
instant (``evidence.calls_in_cgroup``) are recorded with it: the checker
requires each to end ``unknown`` with ``worker_lost`` promptly.

Window faults (``crash_*``) write the crash point's name into the arm file
the supervisor watches (``supervisor/crashpoints.py``) and wait up to
``arm_wait_s`` for it to be claimed; the kill's instant is the claim's
(``.fired`` file). They are armed only when the farm is steady (``steady``:
the supervisor up and every session's event client subscribed to it), so the
kill lands where a client watches: armed while a restarted supervisor is still
resuming, a point would fire before any client is back and show nothing. On a farm
of several supervisors, any of them may claim the point; the record names the
claimer's ``owner`` and ``sessions`` (the lease rows naming it, read right after the
claim), the only sessions it can hit.
``interrupt_tool`` asks the harness's ``interrupter`` to interrupt a turn with
a long tool call open.

Other targets: the broker, the supervisor and the scripted provider are
SIGKILLed (the farm restarts them). On a farm of several supervisors (PostgreSQL),
``supervisor_kill`` and ``supervisor_stop`` pick, by the leases table read at that
instant (``pgfarm.owners``), a supervisor that owns sessions, and record which
(``owner``, ``sessions``: those are the sessions it hits); ``supervisor_stop``
SIGSTOPs it for the lease plus the fault's 0.5-2 s, so its leases lapse and others
take its sessions over, then SIGCONTs it (fencing: it must publish nothing more for
them). ``pg_restart`` restarts the farm's PostgreSQL (immediate shutdown, then
start on the same port: ``PgServer.restart``) while turns run. ``store_busy``
holds SQLite's write lock from a second connection; ``store_slow`` switches the
store's slow-disk hook on (a flag file, see ``supervisor.store.slowdisk``) for the
fault's duration.

Invariants:
- Every record says what was hit: kind, target name, pid, and for worker
  faults the services it had in flight at the instant it was chosen; and
  ``hit``: whether the fault landed in its window (a crash point claimed; a
  tool kill with a tool process of the run in the worker's cgroup; a model
  kill holding a model request; ...), so a report shows it, not just the try.
- Every wait is bounded (STATUS calls, the target search, hangs, lock holds).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sqlite3
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Final

from broker.client import BrokerClient
from broker.errors import BrokerError
from supervisor.chaos import pgfarm
from supervisor.chaos.evidence import calls_in_cgroup
from supervisor.chaos.schedule import WINDOW_POINTS, Fault
from supervisor.farm.root import Farm

log = logging.getLogger(__name__)

# kind -> what the target worker must hold: a service, "" (nothing) or "*" (anything)
WANT: Final = {"worker_kill_model": "model", "worker_kill_tool": "tool",
               "worker_kill_idle": "", "worker_hang": "*"}
FREEZE_SETTLE_S: Final = 0.05  # SIGSTOP to the STATUS read that says what was held
SINGLE: Final = {"broker_kill": "broker", "supervisor_kill": "supervisor",
                 "provider_kill": "fakellm-",
                 # one of the brokers of a two-broker farm: "broker" or "broker-2"
                 "broker_kill_one": "broker"}


class Injector:
    def __init__(self, farm: Farm, broker: BrokerClient, slow_flag: Path, *,
                 wait_s: float = 3.0, arm_path: Path | None = None, run_tag: str = "",
                 interrupter: Callable[[int], Awaitable[dict[str, Any] | None]] | None = None,
                 arm_wait_s: float = 6.0,
                 steady: Callable[[], Awaitable[bool]] | None = None,
                 more_brokers: Sequence[BrokerClient] = (), store_url: str | None = None,
                 lease_s: float = 0.0,
                 pg_restart: Callable[[], Awaitable[float]] | None = None) -> None:
        self.farm = farm
        self.broker = broker
        self.brokers = [broker, *more_brokers]  # a worker's calls may be on any of them
        self.slow_flag = slow_flag
        self.wait_s = wait_s
        self.arm_path = arm_path
        self.run_tag = run_tag
        self.interrupter = interrupter
        self.arm_wait_s = arm_wait_s
        self.steady = steady
        self.store_url = store_url  # several supervisors: the shared PostgreSQL store
        self.lease_s = lease_s
        self.pg_restart = pg_restart  # restarts the farm's PostgreSQL; seconds it was down

    def _running(self, prefix: str) -> list[Any]:
        return sorted((c for c in self.farm.tree.children.values()
                       if c.spec.name.startswith(prefix) and c.pid and c.state == "running"),
                      key=lambda c: c.spec.name)

    async def _status_workers(self) -> list[dict[str, Any]]:
        """Every worker the brokers list; a worker serving several brokers (one
        identity at each) is one entry holding what it holds at all of them."""
        seen: dict[str, dict[str, Any]] = {}
        for broker in self.brokers:
            try:
                status = await broker.status(timeout_s=1.0)
            except (BrokerError, TimeoutError) as exc:
                log.info("chaos: broker STATUS failed (%s); retrying", exc)
                continue
            here: dict[str, dict[str, Any]] = {}
            for svc in (status.get("workers") or {}).values():
                for w in svc.get("workers", []):
                    here[str(w.get("identity"))] = w
            for ident, w in here.items():
                if ident in seen:
                    both = dict(seen[ident])
                    both["in_flight_services"] = sorted(
                        [*(both.get("in_flight_services") or []),
                         *(w.get("in_flight_services") or [])])
                    seen[ident] = both
                else:
                    seen[ident] = w
        return list(seen.values())

    async def find_worker(self, want: str, pick: int) -> tuple[Any, list[str]] | None:
        """A running worker child in the wanted state, and what it held; or None."""
        deadline = time.monotonic() + self.wait_s
        fallback = None
        while True:
            by_pid = {c.pid: c for c in self._running("worker-")}
            candidates = []
            for w in await self._status_workers():
                services = list(w.get("in_flight_services") or [])
                child = by_pid.get((w.get("info") or {}).get("pid"))
                if child is None:
                    continue
                if (want == "*" and services) or (want == "" and not services) or (
                        want not in ("", "*") and want in services):
                    candidates.append((child, services))
            candidates.sort(key=lambda cs: cs[0].spec.name)
            if want == "tool" and candidates:
                # A worker mid long call (seen in its cgroup) first: the kill then
                # surely lands mid-call; else any worker holding a tool request.
                fallback = fallback or candidates[pick % len(candidates)]
                candidates = [cs for cs in candidates
                              if calls_in_cgroup(cs[0].pid, self.run_tag)]
            if candidates:
                return candidates[pick % len(candidates)]
            if time.monotonic() >= deadline:
                return fallback
            await asyncio.sleep(0.05)

    async def _held_by(self, pid: int) -> list[str] | None:
        """The services of the requests the broker says worker ``pid`` holds (None:
        unknown, the broker did not answer or does not list it)."""
        for w in await self._status_workers():
            if (w.get("info") or {}).get("pid") == pid:
                return list(w.get("in_flight_services") or [])
        return None

    async def fire(self, fault: Fault, before_kill: Any) -> dict[str, Any]:
        """Inject ``fault``; ``before_kill(service)`` is called at the instant of the
        hit (to mark every session's progress). Returns the fault's record."""
        kind = fault.kind
        rec: dict[str, Any] = {"kind": kind}
        if kind in WANT:
            found = await self.find_worker(WANT[kind], fault.pick)
            if found is None:
                rec["skipped"] = f"no worker was {_state_name(WANT[kind])} within {self.wait_s}s"
                return rec
            child, services = found
            pid = child.pid
            rec.update(target=child.spec.name, pid=pid, in_flight=services)
            # Freeze it first: from now on it can answer nothing, so what the broker
            # says it holds a moment later is exactly what the fault takes from it.
            _signal(pid, signal.SIGSTOP)
            before_kill(_service_of(WANT[kind], services))
            try:
                await asyncio.sleep(FREEZE_SETTLE_S)  # answers already sent reach the broker
                rec["held"] = await self._held_by(pid)
                rec["calls"] = sorted(calls_in_cgroup(pid, self.run_tag))  # (session, k)
                rec["hit"] = _worker_hit(kind, rec["held"], rec["calls"])
                if kind == "worker_hang":
                    await asyncio.sleep(max(0.0, fault.duration_s - FREEZE_SETTLE_S))
                    rec["duration_s"] = fault.duration_s
                else:
                    _signal(pid, signal.SIGKILL)
            finally:
                _signal(pid, signal.SIGCONT)
            return rec
        if kind == "supervisor_stop" or (kind == "supervisor_kill" and self.store_url):
            return await self._supervisor(fault, rec, before_kill)
        if kind in SINGLE:
            targets = self._running(SINGLE[kind])
            if not targets:
                rec["skipped"] = f"no running {SINGLE[kind].rstrip('-')} process"
                return rec
            child = targets[fault.pick % len(targets)]
            # One of two brokers: a hit only while the other one runs to take over.
            landed = kind != "broker_kill_one" or len(targets) >= 2
            rec.update(target=child.spec.name, pid=child.pid, hit=landed)
            before_kill(None)
            _signal(child.pid, signal.SIGKILL)
            return rec
        if kind == "pg_restart":
            if self.pg_restart is None:
                rec["skipped"] = ("no PostgreSQL of this run to restart (a --store-url "
                                  "server is not the harness's)")
                return rec
            before_kill(None)
            rec.update(target="postgresql", hit=True,
                       down_s=round(await self.pg_restart(), 3))
            return rec
        if kind in WINDOW_POINTS:
            return await self._arm(WINDOW_POINTS[kind], rec, before_kill)
        if kind == "interrupt_tool" and self.interrupter is not None:
            hit = await self.interrupter(fault.pick)
            if hit is None:
                rec["skipped"] = "no long tool call was starting"
            else:
                sent = hit.pop("sent_at", None)
                if sent is not None:
                    before_kill(None, sent)
                rec.update(hit)
                rec["hit"] = "error" not in hit  # the interrupt reached the open call's turn
            return rec
        if kind == "store_busy":
            await asyncio.to_thread(hold_write_lock, self.farm.paths.db, fault.duration_s)
            rec.update(duration_s=fault.duration_s, hit=True)
            return rec
        if kind == "store_slow":
            self.slow_flag.touch()
            try:
                await asyncio.sleep(fault.duration_s)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    self.slow_flag.unlink()
            rec.update(duration_s=fault.duration_s, hit=True)
            return rec
        rec["skipped"] = "not a timed fault"
        return rec


    async def _supervisor(self, fault: Fault, rec: dict[str, Any],
                          before_kill: Any) -> dict[str, Any]:
        """SIGKILL (``supervisor_kill``) or SIGSTOP past its lease, then SIGCONT
        (``supervisor_stop``), one supervisor of several, preferring those that own
        sessions (the leases table, read now). A hit: it owned sessions, and another
        supervisor ran to take them."""
        targets = self._running("supervisor")
        if not targets:
            rec["skipped"] = "no running supervisor process"
            return rec
        if self.store_url is None:
            rec["skipped"] = "not a farm of several supervisors on PostgreSQL"
            return rec
        held = await asyncio.to_thread(pgfarm.owners, self.store_url)
        by_pid = {o.pid: o for o in (held or {}).values()}
        busy = [c for c in targets if c.pid in by_pid and by_pid[c.pid].sessions]
        child = (busy or targets)[fault.pick % len(busy or targets)]
        own = by_pid.get(child.pid)
        sessions = list(own.sessions) if own is not None else None  # None: unknown
        rec.update(target=child.spec.name, pid=child.pid,
                   owner=own.owner if own is not None else None, sessions=sessions or [],
                   hit=bool(sessions) and len(targets) >= 2)
        if held is None:
            rec["note"] = "the leases could not be read: its sessions are unknown"
        if fault.kind == "supervisor_kill":
            before_kill(None, sessions=sessions)
            _signal(child.pid, signal.SIGKILL)
            return rec
        stop_s = self.lease_s + fault.duration_s
        _signal(child.pid, signal.SIGSTOP)
        before_kill(None, sessions=sessions)
        try:
            await asyncio.sleep(stop_s)
        finally:
            _signal(child.pid, signal.SIGCONT)
        rec["duration_s"] = round(stop_s, 3)
        return rec

    async def _arm(self, point: str, rec: dict[str, Any], before_kill: Any) -> dict[str, Any]:
        """Arm crash point ``point`` once; wait for the supervisor to reach it."""
        if self.arm_path is None:
            rec["skipped"] = "crash points are not armable in this farm"
            return rec
        if self.steady is not None and not await self.steady():
            rec["skipped"] = ("the supervisor was restarting or a client was not subscribed "
                              "to it: a kill now would test nothing a client sees")
            return rec
        fired = f"{self.arm_path}.fired"
        _write_arm(str(self.arm_path), point, fired)
        rec.update(target="supervisor", point=point)
        deadline = time.monotonic() + self.arm_wait_s
        while time.monotonic() < deadline:
            if _exists(fired):
                break
            await asyncio.sleep(0.02)
        if not _exists(fired) and not _disarm(str(self.arm_path)):
            await asyncio.sleep(0.1)  # claimed just as we disarmed: its .fired follows
        if not _exists(fired):
            rec["skipped"] = f"crash point {point} not reached within {self.arm_wait_s}s"
            return rec
        # the instant of the kill, from the claim (wall clock) mapped to monotonic
        wall, pid = _fired_at(fired)
        rec.update(hit=True, fired_pid=pid)  # the supervisor claimed it and killed itself
        at = time.monotonic() - max(0.0, time.time() - wall) if wall else None
        if self.store_url is None:  # one supervisor: every session is its own
            before_kill(None, at)
            return rec
        sessions = await self._owned_by(self.store_url, pid, rec)
        rec["sessions"] = sessions or []
        before_kill(None, at, sessions=sessions)
        return rec

    async def _owned_by(self, url: str, pid: int | None,
                        rec: dict[str, Any]) -> list[str] | None:
        """The sessions whose lease rows name the supervisor of ``pid`` (it just killed
        itself: its rows stay until another claims them, a lease later); None: unknown."""
        held = await asyncio.to_thread(pgfarm.owners, url, live=False)
        if held is None or pid is None:
            rec["note"] = ("the leases or the claimer's pid could not be read: its "
                           "sessions are unknown")
            return None
        own = next((o for o in held.values() if o.pid == pid), None)
        rec["owner"] = own.owner if own is not None else None
        return list(own.sessions) if own is not None else []


def _write_arm(path: str, point: str, fired: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(fired)
    with open(f"{path}.tmp", "w") as f:
        f.write(point)
    os.replace(f"{path}.tmp", path)  # atomic: the supervisor never reads half a name


def _exists(path: str) -> bool:
    return os.path.exists(path)


def _disarm(path: str) -> bool:
    """Remove the arm file; False if it was already gone (claimed)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _fired_at(fired: str) -> tuple[float | None, int | None]:
    """The claim's wall-clock time and the claiming supervisor's pid."""
    for _ in range(20):  # the claimer appends its time right after the rename
        with open(fired) as f:
            parts = f.read().split()
        if len(parts) >= 3:
            with contextlib.suppress(ValueError):
                return float(parts[1]), int(parts[2])
        time.sleep(0.005)
    return None, None


def _worker_hit(kind: str, held: list[str] | None, calls: list[Any]) -> bool:
    """Whether a worker fault landed in its window: a kill mid tool call had one of
    the run's tool processes in the worker's cgroup; mid model call, a model request
    held; an idle kill, nothing held; a hang, anything held."""
    if kind == "worker_kill_tool":
        return bool(calls)
    if kind == "worker_kill_model":
        return "model" in (held or [])
    if kind == "worker_kill_idle":
        return held == []
    return bool(held)


def _state_name(want: str) -> str:
    return {"": "idle", "*": "busy"}.get(want, f"running a {want} request")


def _service_of(want: str, services: list[str]) -> str | None:
    """What the hit worker held: every request on it is lost, whatever was wanted."""
    if not services:
        return None
    return services[0] if len(set(services)) == 1 else "mixed"


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def hold_write_lock(db: Path, seconds: float) -> None:
    """Hold SQLite's write lock from another connection (SQLITE_BUSY for the store)."""
    con = sqlite3.connect(db, timeout=5)
    try:
        con.execute("BEGIN IMMEDIATE")
        time.sleep(seconds)
        con.rollback()
    finally:
        con.close()
