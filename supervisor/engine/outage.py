"""Waiting out an unreachable store: a session's step pauses, visibly, and goes on when
the store is back (docs/storage.md, "PostgreSQL lost while running").

``StoreUnavailable`` (PostgreSQL down, restarting, cut off) is the one store error that
says "this same write may succeed later"; ``SessionManager.store_commit`` hands it here.

- Only a session's own work waits: its driver (turns, hooks, compaction, shutdown) sets
  ``PAUSABLE``, and the tasks it starts inherit it. A client's own request (an input
  admitted while the store is down) fails at once with the retryable
  ``store_unavailable``: no client call hangs on an outage.
- While a step waits its session is *paused*: ``describe`` says ``status: "paused"``
  with ``store_outage`` (since when, the deadline, the error), the manager's ``stats``
  counts it (``corral status``), and subscribers get the live-only notice
  ``store_status`` (``state: "unavailable"``, then ``"available"`` when the step has
  committed). A notice carries no event content and no sequence: nothing that is not
  committed is ever shown, and a replay never holds it.
- The step is retried with capped backoff (``BACKOFF_S``); the store reconnects at each
  attempt. Writes are idempotent by (session, sequence), so a retry after a COMMIT whose
  outcome was lost is safe.
- Bound: ``EngineConfig.store_outage_s`` from the step's first failure. Past it the step
  fails ``StoreFailed(kind="store_unavailable", retryable)``: the turn ends, and its
  failure report (the ``error`` event, ``turn_aborted``) is its next step, which waits
  for the store with no deadline of its own (the session stays paused, ``reporting``),
  so the failure is committed and shown once the store is back, never dropped. Every
  attempt is bounded by the store's connect timeout; the wait ends when the store is
  back, when the session is given up (another supervisor owns it; a session no longer
  in the manager's memory never waits), or when the supervisor stops
  (``Outages.abandon``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

from supervisor.engine import events as ev
from supervisor.engine.errors import TurnError
from supervisor.store import SessionId, StoreUnavailable

log = logging.getLogger(__name__)

# Set by a session's driver: the store calls made by its work may wait out an outage.
PAUSABLE: ContextVar[bool] = ContextVar("corral_store_pausable", default=False)
BACKOFF_S = (0.1, 0.2, 0.5, 1.0)  # then 1 s between attempts


class StoreFailed(TurnError):
    """The durable store refused a step; the turn cannot continue."""

    kind = "store_failed"


@dataclass(slots=True)
class Outage:
    """One session's wait for the store (``Session.store_outage`` while it lasts)."""

    since: float  # wall clock of the first failed attempt
    since_mono: float
    deadline_mono: float
    error: str
    attempts: int = 0
    reporting: bool = False  # the deadline passed: the turn's failure report waits

    def view(self) -> dict[str, Any]:
        now = time.monotonic()
        return {"since": round(self.since, 3),
                "waited_s": round(now - self.since_mono, 2),
                "deadline_in_s": None if self.reporting
                else round(max(0.0, self.deadline_mono - now), 2),
                "reporting_failure": self.reporting, "attempts": self.attempts,
                "error": self.error}


class Paused(Protocol):
    """What of a session the wait touches (``session.Session``)."""

    store_outage: Outage | None
    fenced: bool

    def publish_live(self, type_: str, payload: dict[str, Any],
                     submission_id: Any) -> None: ...


class Outages:
    """The manager's waits for the store: the deadline, and ``abandon`` at shutdown."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self._abandoned = asyncio.Event()

    def abandon(self) -> None:
        """The supervisor stops: every wait ends now (the step fails; at the next start
        the session resumes from what is committed, as after a crash)."""
        self._abandoned.set()

    async def wait(self, sid: SessionId, session: Paused | None,
                   exc: StoreUnavailable) -> None:
        """One pause between two attempts of a step that failed with ``exc``; raises
        ``StoreFailed`` when the step must not wait (not a session's own work, the
        deadline passed, the session given up, the supervisor stopping)."""
        if not PAUSABLE.get():
            raise StoreFailed(f"the store is unreachable: {exc}", kind="store_unavailable",
                              retryable=True) from exc
        if self._abandoned.is_set():
            raise StoreFailed(f"the supervisor is stopping while the store is unreachable: "
                              f"{exc}", kind="store_unavailable", retryable=True) from exc
        if session is None or session.fenced:  # given up (or gone): nobody to wait for
            raise StoreFailed("the session is no longer on this supervisor (given up to "
                              "another)", kind="lease_lost") from exc
        outage = session.store_outage
        now = time.monotonic()
        if outage is None:
            outage = Outage(time.time(), now, now + self.wait_s, ev.clip(str(exc), 512))
            log.warning("session %s: the store is unreachable; its work is paused for up "
                        "to %.0fs: %s", sid, self.wait_s, exc)
            session.store_outage = outage
            session.publish_live(ev.STORE_STATUS, {"state": "unavailable",
                                                   **outage.view()}, None)
        outage.attempts += 1
        outage.error = ev.clip(str(exc), 512)
        if not outage.reporting and now >= outage.deadline_mono:
            outage.reporting = True
            log.error("session %s: the store stayed unreachable for %.0fs; the turn ends "
                      "and its failure is recorded when the store is back", sid, self.wait_s)
            raise StoreFailed(f"the store stayed unreachable for {self.wait_s:.0f}s "
                              f"(store_outage_s); the turn was stopped: {exc}",
                              kind="store_unavailable", retryable=True) from exc
        delay = BACKOFF_S[min(outage.attempts - 1, len(BACKOFF_S) - 1)]
        if not outage.reporting:
            delay = max(0.0, min(delay, outage.deadline_mono - now))
        try:
            async with asyncio.timeout(delay):
                await self._abandoned.wait()
        except TimeoutError:
            pass

    @staticmethod
    def resumed(sid: SessionId, session: Paused | None) -> None:
        """The step committed: the session is no longer paused (and says so)."""
        if session is None or session.store_outage is None:
            return
        outage, session.store_outage = session.store_outage, None
        waited = time.monotonic() - outage.since_mono
        log.warning("session %s: the store is back after %.1fs (%d attempts); work goes on",
                    sid, waited, outage.attempts)
        session.publish_live(ev.STORE_STATUS, {"state": "available",
                                               "waited_s": round(waited, 2),
                                               "attempts": outage.attempts}, None)
