"""Firing one scheduled fault at a real target in the running farm.

Worker faults are aimed by state, not at random: the broker's STATUS lists,
per worker, the services of the requests it holds (``in_flight_services``);
``worker_kill_model`` picks a worker streaming a model answer,
``worker_kill_tool`` one running a tool, ``worker_kill_idle`` one holding
nothing, ``worker_hang`` one holding anything. The worker is matched to the
farm's child by the pid in its READY info. If no worker is in the wanted state
the injector polls STATUS for at most ``wait_s``; if still none, the fault is
recorded as skipped (with why), never as injected.

Other targets: the broker, the supervisor and the scripted provider are
SIGKILLed (the farm restarts them); ``store_busy`` holds SQLite's write lock
from a second connection; ``store_slow`` switches the store's slow-disk hook
on (a flag file, see ``supervisor.store.slowdisk``) for the fault's duration.

Invariants:
- Every record says what was hit: kind, target name, pid, and for worker
  faults the services it had in flight at the instant it was chosen.
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
from pathlib import Path
from typing import Any, Final

from broker.client import BrokerClient
from broker.errors import BrokerError
from supervisor.chaos.schedule import Fault
from supervisor.farm.root import Farm

log = logging.getLogger(__name__)

# kind -> what the target worker must hold: a service, "" (nothing) or "*" (anything)
WANT: Final = {"worker_kill_model": "model", "worker_kill_tool": "tool",
               "worker_kill_idle": "", "worker_hang": "*"}
SINGLE: Final = {"broker_kill": "broker", "supervisor_kill": "supervisor",
                 "provider_kill": "fakellm-"}


class Injector:
    def __init__(self, farm: Farm, broker: BrokerClient, slow_flag: Path, *,
                 wait_s: float = 3.0) -> None:
        self.farm = farm
        self.broker = broker
        self.slow_flag = slow_flag
        self.wait_s = wait_s

    def _running(self, prefix: str) -> list[Any]:
        return sorted((c for c in self.farm.tree.children.values()
                       if c.spec.name.startswith(prefix) and c.pid and c.state == "running"),
                      key=lambda c: c.spec.name)

    async def _status_workers(self) -> list[dict[str, Any]]:
        try:
            status = await self.broker.status(timeout_s=1.0)
        except (BrokerError, TimeoutError) as exc:
            log.info("chaos: broker STATUS failed (%s); retrying", exc)
            return []
        seen: dict[str, dict[str, Any]] = {}
        for svc in (status.get("workers") or {}).values():
            for w in svc.get("workers", []):
                seen[str(w.get("identity"))] = w
        return list(seen.values())

    async def find_worker(self, want: str, pick: int) -> tuple[Any, list[str]] | None:
        """A running worker child in the wanted state, and what it held; or None."""
        deadline = time.monotonic() + self.wait_s
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
            if candidates:
                candidates.sort(key=lambda cs: cs[0].spec.name)
                return candidates[pick % len(candidates)]
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(0.05)

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
            before_kill(_service_of(WANT[kind], services))
            if kind == "worker_hang":
                _signal(pid, signal.SIGSTOP)
                try:
                    await asyncio.sleep(fault.duration_s)
                finally:
                    _signal(pid, signal.SIGCONT)
                rec["duration_s"] = fault.duration_s
            else:
                _signal(pid, signal.SIGKILL)
            return rec
        if kind in SINGLE:
            targets = self._running(SINGLE[kind])
            if not targets:
                rec["skipped"] = f"no running {SINGLE[kind].rstrip('-')} process"
                return rec
            child = targets[fault.pick % len(targets)]
            rec.update(target=child.spec.name, pid=child.pid)
            before_kill(None)
            _signal(child.pid, signal.SIGKILL)
            return rec
        if kind == "store_busy":
            await asyncio.to_thread(hold_write_lock, self.farm.paths.db, fault.duration_s)
            rec["duration_s"] = fault.duration_s
            return rec
        if kind == "store_slow":
            self.slow_flag.touch()
            try:
                await asyncio.sleep(fault.duration_s)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    self.slow_flag.unlink()
            rec["duration_s"] = fault.duration_s
            return rec
        rec["skipped"] = "not a timed fault"
        return rec


def _state_name(want: str) -> str:
    return {"": "idle", "*": "busy"}.get(want, f"running a {want} request")


def _service_of(want: str, services: list[str]) -> str | None:
    if want in ("model", "tool"):
        return want
    if want == "*" and services:
        return services[0] if len(set(services)) == 1 else "mixed"
    return None


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
