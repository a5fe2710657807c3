"""The chaos farm's PostgreSQL side: its database, who owns what, and the fencing evidence.

A chaos farm of several supervisors runs on PostgreSQL: the URL given
(``--store-url``, an empty database) or, by default, a throwaway cluster
(``supervisor/devtools/pgserver.py``: Debian's binaries, a temporary directory, a
loopback port, run as an unprivileged user), which only that cluster lets the
``pg_restart`` fault restart. The harness reads, with short-lived connections of its
own (never the farm's):

- ``owners``: which supervisor (owner id, and the pid it recorded in ``supervisors``)
  holds a live lease on which sessions, at the instant a supervisor fault fires (its
  target and the sessions it really hits); for a crash point, right after the claim,
  the lease rows that still name the supervisor that killed itself;
- ``event_leases``: after the run, each session's events as the disk holds them,
  with the lease (owner, epoch) each was written under (schema v3), and the lease row
  as it ended: the evidence of the ``fencing`` invariant.

Invariants: every connection has a connect timeout and is closed; a database that is
unreachable at a fault gives "unknown" (None), never a guess; the throwaway cluster
is stopped by pid (``PgServer.stop``) by whoever started it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psycopg

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 3


@dataclass(frozen=True)
class Owner:
    owner: str
    pid: int | None  # as the supervisor recorded it at start (``supervisors.pid``)
    sessions: tuple[str, ...]


def owners(url: str, *, live: bool = True) -> dict[str, Owner] | None:
    """Lease owners: owner id -> its pid and sessions; None if unreachable. ``live``:
    only unexpired leases; without it, every lease row naming an owner (a supervisor
    that just died still names its sessions until another claims them)."""
    live_only = " AND l.expires_at > extract(epoch from clock_timestamp())" if live else ""
    try:
        with psycopg.connect(url, connect_timeout=CONNECT_TIMEOUT_S,
                             autocommit=True) as conn:
            rows = conn.execute(
                "SELECT l.owner, v.pid, s.session_id FROM leases l"
                " JOIN sessions s ON s.sid = l.sid"
                " LEFT JOIN supervisors v ON v.supervisor_id = l.owner"
                " WHERE l.owner IS NOT NULL" + live_only +
                " ORDER BY l.owner, s.session_id").fetchall()
    except psycopg.Error as exc:
        log.info("chaos: reading the leases failed: %s", exc)
        return None
    out: dict[str, list[str]] = {}
    pids: dict[str, int | None] = {}
    for owner, pid, sid in rows:
        out.setdefault(str(owner), []).append(str(sid))
        pids[str(owner)] = None if pid is None else int(pid)
    return {o: Owner(o, pids[o], tuple(s)) for o, s in out.items()}


EventLease = tuple[int, str | None, int | None]  # (sequence, lease owner, lease epoch)


def event_leases(url: str, session_ids: list[str]
                 ) -> tuple[dict[str, list[EventLease]], dict[str, tuple[str | None, int]]]:
    """Per session: its events' (sequence, lease_owner, lease_epoch) in sequence order,
    and its lease row as it is now (owner, epoch)."""
    events: dict[str, list[EventLease]] = {sid: [] for sid in session_ids}
    lease: dict[str, tuple[str | None, int]] = {}
    with psycopg.connect(url, connect_timeout=CONNECT_TIMEOUT_S, autocommit=True) as conn:
        for sid, seq, owner, epoch in conn.execute(
                "SELECT s.session_id, e.sequence, e.lease_owner, e.lease_epoch FROM events e"
                " JOIN sessions s ON s.sid = e.sid WHERE s.session_id = ANY(%s)"
                " ORDER BY s.session_id, e.sequence", (session_ids,)):
            events[str(sid)].append((int(seq), owner, None if epoch is None else int(epoch)))
        for sid, owner, epoch in conn.execute(
                "SELECT s.session_id, l.owner, l.epoch FROM leases l"
                " JOIN sessions s ON s.sid = l.sid WHERE s.session_id = ANY(%s)",
                (session_ids,)):
            lease[str(sid)] = (owner, int(epoch))
    return events, lease


def is_empty(url: str) -> bool:
    """Whether the database holds no sessions (a fresh one, or no schema yet)."""
    with psycopg.connect(url, connect_timeout=CONNECT_TIMEOUT_S, autocommit=True) as conn:
        row = conn.execute("SELECT to_regclass('sessions') IS NOT NULL").fetchone()
        if row is None or not row[0]:
            return True
        row = conn.execute("SELECT count(*) FROM sessions").fetchone()
        return row is not None and int(row[0]) == 0
