"""Keeping this supervisor's session leases (several supervisors on one PostgreSQL store).

At start-up ``claim_at_start`` takes the sessions still leased to this supervisor's id
(a restart takes its own back at once, under new epochs) and free or expired ones; the
engine then resumes them as after a restart. ``run`` then:

- every third of the lease, stamps this supervisor's heartbeat (placement counts only
  supervisors heard within a lease) and renews the leases; each one lost (lapsed
  while this process was paused or cut off from the database, or taken by another
  supervisor) is given up (``give_up``): nothing more is published for it and it
  leaves memory;
- every 0.5 s (at most every third of the lease), and at the moment the soonest lease of
  another supervisor lapses, claims sessions nobody holds a live lease on (a dead
  supervisor's, after its lease lapsed), at most ``claim_batch`` per round (a full
  round is followed by another at once), and resumes them (``take_over``), several at
  a time.

At a clean stop (SIGTERM, once the engine has stopped) ``sign_off`` releases every
lease this supervisor holds, so the others take its sessions at their next claim
round instead of a lease later.

It also answers, for the client endpoint, where a session lives (``redirect``: its live
owner's advertised address) and where a new one goes (``place``: the least loaded).

Invariants: a failure to reach the store skips the round (the process stays up; the
store's fencing refuses writes of leases that lapsed meanwhile); every wait is bounded
by the lease period; the task is owned by the supervisor's TaskGroup.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
from collections.abc import Container
from pathlib import Path
from typing import Any, Protocol, cast

import psutil

from broker.ratelog import RateLimitedLog
from supervisor.store import SessionId, SessionStore, StoreError

log = logging.getLogger(__name__)
# During a store outage every round fails: one line per period, with the count.
_skips = RateLimitedLog(log, 10.0)
DEFAULT_CLAIM_BATCH = 64
CLAIM_PERIOD_S = 0.5  # how often to look for sessions whose owner's lease lapsed
LAPSE_MARGIN_S = 0.005  # a claim goes this long after the soonest foreign lease lapses
RESUME_CONCURRENCY = 8  # claimed sessions resumed at once (loads in flight)
ROSTER_WINDOW_LEASES = 6  # status lists supervisors heard within this many leases


class Engine(Protocol):
    def give_up(self, sid: SessionId) -> None: ...

    async def take_over(self, sid: SessionId) -> None: ...


class Leased(Protocol):
    """What a store in lease mode offers (``PgStore`` with an owner)."""

    owner: str | None
    lease_s: float

    async def claim(self, limit: int, *, own: bool = False) -> list[SessionId]: ...

    async def renew(self) -> list[SessionId]: ...

    async def sign_off(self) -> int: ...


def supervisor_id(home: Path, given: str | None = None) -> str:
    """This supervisor's owner id: ``given``, else stable for (host, home), so a restart
    on the same host takes its own sessions back at once (under new epochs)."""
    if given:
        return given
    digest = hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:12]
    return f"{socket.gethostname()[:40]}-{digest}"


def lease_options(url: str | None, home: Path, lease_s: float,
                  given: str | None) -> dict[str, Any]:
    """The store options of lease mode: none for SQLite (one supervisor per file)."""
    if url is None:
        return {}
    return {"owner": supervisor_id(home, given), "lease_s": lease_s}


async def start(store: SessionStore, engine: Engine, tg: asyncio.TaskGroup) -> None:
    """In lease mode: take this supervisor's sessions (before the engine resumes what it
    holds) and keep the leases in a task of ``tg``. Otherwise nothing."""
    if getattr(store, "owner", None) is None:
        return
    leased = cast(Leased, store)
    await claim_at_start(leased)
    tg.create_task(run(leased, engine), name="leases")


SIGN_OFF_TIMEOUT_S = 5.0  # a clean stop waits this long, at most, to release its leases


async def sign_off(store: SessionStore) -> None:
    """In lease mode, at a clean stop once the engine has stopped: release this
    supervisor's leases (``PgStore.sign_off``), so the others resume its sessions at
    their next claim round (``CLAIM_PERIOD_S``) rather than a lease later, and stop
    placing new sessions here. Bounded; a failure only leaves the leases to lapse."""
    if getattr(store, "owner", None) is None:
        return
    try:
        async with asyncio.timeout(SIGN_OFF_TIMEOUT_S):
            released = await cast(Leased, store).sign_off()
    except (StoreError, TimeoutError) as exc:
        log.warning("stopping: the leases were not released (they lapse instead): %s", exc)
        return
    log.info("stopping: released %d session lease(s) for the other supervisors", released)


async def lease_status(store: SessionStore) -> dict[str, Any] | None:
    """For ``status``: this supervisor's id, the lease period, and each supervisor of the
    shared store (None: no lease mode). Read from the shared store, so every supervisor
    shows the same picture. ``owners`` lists every supervisor heard within
    ``ROSTER_WINDOW_LEASES`` leases (at least a minute) or holding live leases, those
    holding none included: its sessions, how long ago it last renewed its leases and
    when the soonest lapses (None without sessions), its client address, host and pid,
    how long ago it was last heard, and ``silent`` when that is more than a lease (a
    paused, cut-off or dead supervisor, whose sessions another one takes over)."""
    owner = getattr(store, "owner", None)
    roster = getattr(store, "roster", None)
    if owner is None or roster is None:
        return None
    lease_s = float(getattr(store, "lease_s", 0.0))
    rows: list[tuple[Any, ...]] = await roster(max(60.0, ROSTER_WINDOW_LEASES * lease_s))
    owners = []
    for who, address, host, pid, heard, n, left in rows:
        heard_s = None if heard is None else round(max(0.0, float(heard)), 2)
        owners.append({
            "id": who, "sessions": int(n),
            "renewed_s_ago": None if left is None else round(max(0.0, lease_s - left), 2),
            "expires_in_s": None if left is None else round(float(left), 2),
            "address": address, "host": host, "pid": pid, "heard_s_ago": heard_s,
            "silent": heard_s is None or heard_s > lease_s})
    return {"self": owner, "lease_s": lease_s, "owners": owners}


async def id_in_use(store: SessionStore) -> str | None:
    """In lease mode, before anything is claimed: why this process may not run under its
    supervisor id (None: it may). Another live process of the same id would have its
    sessions taken at once (a start claims the sessions leased to its own id) and its
    clients redirected here. Live: heard within a lease and not this process; on this
    host a dead pid is not live (a restart after a crash or a kill)."""
    holder = getattr(store, "holder", None)
    owner = getattr(store, "owner", None)
    if owner is None or holder is None:
        return None
    found: tuple[str, int, str, float] | None = await holder()
    if found is None:
        return None
    host, pid, address, heard_s = found
    if heard_s > float(getattr(store, "lease_s", 0.0)):
        return None
    if host == socket.gethostname() and (pid == os.getpid() or not psutil.pid_exists(pid)):
        return None
    return (f"supervisor id {owner!r} is in use by pid {pid} on host {host} (heard "
            f"{max(0.0, heard_s):.1f}s ago, serving {address}); two processes of one id "
            "would take each other's sessions: give this one its own --supervisor-id (the "
            "default is made of the host name and --home)")


async def claim_at_start(store: Leased, batch: int = DEFAULT_CLAIM_BATCH) -> list[SessionId]:
    got = await store.claim(batch, own=True)
    if got:
        log.info("took %d sessions at start-up (owner %s)", len(got), store.owner)
    return got


async def run(store: Leased, engine: Engine, *, batch: int = DEFAULT_CLAIM_BATCH,
              claim_period_s: float = CLAIM_PERIOD_S,
              resume_concurrency: int = RESUME_CONCURRENCY) -> None:
    """Renew (and stamp this supervisor's heartbeat) every third of the lease; look for
    sessions to take over every ``claim_period_s`` (at most a third of the lease) AND
    at the moment the soonest lease of another supervisor lapses (``next_lapse``), so a
    dead supervisor's sessions are claimed on their leases' expiry; resume the claimed
    ones ``resume_concurrency`` at a time (measured: ``takeover_s`` in
    docs/multihost.md)."""
    renew_s = store.lease_s / 3
    tick_s = min(renew_s, claim_period_s)
    next_renew = 0.0
    loop = asyncio.get_running_loop()
    wake_at = loop.time()  # the first round at once: it learns the next lapse
    while True:
        await asyncio.sleep(max(0.0, wake_at - loop.time()))
        wake_at = loop.time() + tick_s
        try:
            async with asyncio.timeout(store.lease_s):
                if loop.time() >= next_renew:
                    beat = getattr(store, "beat", None)
                    if beat is not None:
                        await beat()
                    for sid in await store.renew():
                        engine.give_up(sid)
                    # only after it succeeded: a round that failed or timed out renews
                    # again at the next tick, not a third of the lease later
                    next_renew = loop.time() + renew_s - tick_s / 2
                claimed = await store.claim(batch)
                if len(claimed) == batch:
                    wake_at = loop.time()  # more may be waiting: the next round at once
                else:
                    wake_at = min(wake_at, await _next_lapse_at(store, loop.time()))
                await resume(engine, claimed, store.owner, resume_concurrency)
        except (StoreError, TimeoutError) as exc:
            _skips.warning("skipped", "lease round skipped: %s", exc)


async def _next_lapse_at(store: Leased, now: float) -> float:
    """When (on this loop's clock) the soonest lease of another supervisor lapses, a
    little after it (the database's clock decides; a claim found early finds nothing
    and the next round comes at once); infinity when unknown."""
    fn = getattr(store, "next_lapse", None)
    left: float | None = await fn() if fn is not None else None
    return now + left + LAPSE_MARGIN_S if left is not None else float("inf")


async def resume(engine: Engine, sids: list[SessionId], owner: str | None,
                 concurrency: int) -> None:
    """Resume the sessions just taken, at most ``concurrency`` at a time (each resume
    is a load from the store: several loads in flight on the store's readers)."""
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(sid: SessionId) -> None:
        async with gate:
            log.info("session %s: taken over (owner %s)", sid, owner)
            await engine.take_over(sid)
    async with asyncio.TaskGroup() as tg:
        for sid in sids:
            tg.create_task(one(sid), name=f"take-over:{sid}")


async def advertise(store: SessionStore, address: str) -> None:
    """In lease mode: record where this supervisor serves clients (the redirect target
    of clients that ask another supervisor for one of its sessions)."""
    fn = getattr(store, "advertise", None)
    if getattr(store, "owner", None) is None or fn is None:
        return
    await fn(address)


async def redirect(store: SessionStore, local: Container[str], session_id: str,
                   tenant: str | None) -> tuple[str, str] | None:
    """(owner, address) of the live supervisor owning ``session_id`` if it is another
    one (a session in ``local``, this supervisor's memory, is answered here without
    asking the store) and ``tenant`` may see the session; None otherwise (the caller then answers
    ``unknown_session``, as for a session that does not exist: another tenant's
    sessions are never confirmed). A store error is a None too: no redirect."""
    locate = getattr(store, "locate", None)
    if getattr(store, "owner", None) is None or locate is None or session_id in local:
        return None
    try:
        found: tuple[str, str, str | None] | None = await locate(SessionId(session_id))
    except StoreError as exc:
        log.warning("could not locate session %s's owner: %s", session_id, exc)
        return None
    if found is None or found[2] != tenant:
        return None
    return found[0], found[1]


async def place(store: SessionStore) -> tuple[str, str] | None:
    """Where a new session goes: (owner, address) of the live supervisor with the fewest
    owned sessions when that is not this one; None (create it here) when this one is
    among the least loaded, outside lease mode, or when the loads cannot be read."""
    owner = getattr(store, "owner", None)
    loads = getattr(store, "loads", None)
    if owner is None or loads is None:
        return None
    try:
        rows: list[tuple[str, str, int]] = await loads()
    except StoreError as exc:
        log.warning("placing a new session here: the loads could not be read: %s", exc)
        return None
    if not rows:
        return None
    least = rows[0][2]
    if any(who == owner and n <= least for who, _, n in rows):
        return None
    return rows[0][0], rows[0][1]
