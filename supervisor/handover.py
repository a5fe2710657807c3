"""Holding a subscription while its session is between owners (several supervisors on
one PostgreSQL store, docs/multihost.md).

Between owners: the session is active in the shared store, no supervisor has it in
memory here, and no other supervisor holds a live lease on it with an advertised
address (the old owner's lease lapsed, or it died before advertising; nobody claimed
it yet). A subscription asked for then is held, not answered with a replay that
ends: ``await_owner`` waits until

- this supervisor took the session over (it is in the manager's memory): the
  subscription then streams from it, replay from the client's last sequence then
  live, so no gap and no duplicate;
- another supervisor holds it: ``unknown_session``, which the client endpoint turns
  into ``moved`` with that owner's address (the client follows it);
- the bound passed (``hold_s``: two leases plus the claim period, so a claim by any
  live supervisor had its chance): ``between_owners``, retryable; the client library
  resubscribes after a short wait, within its own reconnect deadline.

Invariants: outside lease mode (SQLite, one supervisor) nothing is held; the wait
polls the store at most every ``POLL_S`` per held subscription and is bounded; a
store error ends the hold with that error (the client retries).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Container

from supervisor import leasing
from supervisor.server import CallError
from supervisor.store import SessionId, SessionStore
from supervisor.wire import ErrorKind

log = logging.getLogger(__name__)
POLL_S = 0.25
CLAIM_MARGIN_S = 1.0


def hold_s(lease_s: float) -> float:
    """How long a subscription is held before ``between_owners``."""
    return 2 * lease_s + leasing.CLAIM_PERIOD_S + CLAIM_MARGIN_S


async def await_owner(store: SessionStore, local: Container[str], session_id: str,
                      tenant: str | None) -> None:
    """Return once the session is in ``local`` (this supervisor's memory) or is not
    active; raise ``CallError`` ``unknown_session`` when another supervisor owns it,
    ``between_owners`` when nobody took it within ``hold_s``."""
    if getattr(store, "owner", None) is None or session_id in local:
        return
    loop = asyncio.get_running_loop()
    lease_s = float(getattr(store, "lease_s", 10.0))
    deadline = loop.time() + hold_s(lease_s)
    held = False
    while session_id not in local:
        record = await store.get_session(SessionId(session_id))
        if record is None or record.status != "active":
            return  # closed or gone: the replay answers (and ends) as without leases
        if await leasing.redirect(store, local, session_id, tenant) is not None:
            raise CallError(ErrorKind.UNKNOWN_SESSION,
                            f"session {session_id} is owned by another supervisor")
        if session_id in local:
            return
        if loop.time() >= deadline:
            raise CallError(ErrorKind.BETWEEN_OWNERS,
                            f"session {session_id} has had no owner for "
                            f"{hold_s(lease_s):.1f}s; resubscribe from the last sequence "
                            "seen")
        if not held:
            held = True
            log.info("session %s is between owners: its subscription is held", session_id)
        await asyncio.sleep(POLL_S)
