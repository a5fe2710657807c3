"""``corral sessions`` on a farm whose sessions are in PostgreSQL (``[store] url``).

Reads the shared store directly, in one read-only transaction (one statement), so it
lists every supervisor's sessions the same from any host, with the farm running or
not, and shows each session's live lease owner: which supervisor runs it, and for how
long its lease still holds. A turn in progress is ``running`` when a supervisor holds
the session's live lease, else ``suspended`` (it resumes when a supervisor claims it).

Invariants: at most ``limit`` + 1 sessions are read; the connection is bounded by
``CONNECT_TIMEOUT_S`` and the statement by ``STATEMENT_TIMEOUT_MS``; never writes;
messages name the URL without its password.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from supervisor.cli.summary import StoreUnreadable, summarize

CONNECT_TIMEOUT_S = 5
STATEMENT_TIMEOUT_MS = 30_000
_NOW = "extract(epoch from clock_timestamp())"
_QUERY = (
    "SELECT s.sid, s.session_id, s.created_at, s.config, s.parent_session_id,"
    " s.fork_sequence, s.status, c.updated_at, c.state, t.turns, t.last_turn_at,"
    " lt.outcome, lt.reason, le.created_at, l.owner, l.epoch,"
    f" l.expires_at - {_NOW}, v.address"
    " FROM sessions s"
    " LEFT JOIN checkpoint_state c ON c.sid = s.sid"
    f" LEFT JOIN leases l ON l.sid = s.sid AND l.owner IS NOT NULL AND l.expires_at > {_NOW}"
    " LEFT JOIN supervisors v ON v.supervisor_id = l.owner"
    " LEFT JOIN LATERAL (SELECT count(*) AS turns,"
    "   max(coalesce(x.ended_at, x.started_at)) AS last_turn_at"
    "   FROM executions x WHERE x.sid = s.sid) t ON true"
    " LEFT JOIN LATERAL (SELECT x.outcome, x.reason FROM executions x WHERE x.sid = s.sid"
    "   ORDER BY x.id DESC LIMIT 1) lt ON true"
    " LEFT JOIN LATERAL (SELECT e.created_at FROM events e WHERE e.sid = s.sid"
    "   ORDER BY e.sequence DESC LIMIT 1) le ON true"
    " ORDER BY s.sid DESC LIMIT %s"
)


def list_pg_sessions(url: str, limit: int,
                     default_route: str) -> tuple[list[dict[str, Any]], bool]:
    """Up to ``limit`` sessions' summaries (newest first) and whether there were more;
    ``StoreUnreadable`` (the redacted URL and why) when PostgreSQL cannot answer."""
    import psycopg

    from supervisor.store.url import redact, scrub

    try:
        with psycopg.connect(url, connect_timeout=CONNECT_TIMEOUT_S,
                             application_name="corral-sessions",
                             options=f"-c statement_timeout={STATEMENT_TIMEOUT_MS}") as conn:
            conn.read_only = True
            rows = conn.execute(_QUERY.encode(), (limit + 1,)).fetchall()
    except psycopg.Error as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = (" (the schema is missing: run corral store migrate)"
                if isinstance(exc, psycopg.errors.UndefinedTable) else "")
        raise StoreUnreadable(f"cannot read the sessions in PostgreSQL at {redact(url)}: "
                              f"{scrub(first, url)}{hint}") from None
    out = []
    for r in rows[:limit]:
        owner = None if r[14] is None else {
            "id": r[14], "epoch": int(r[15]), "lease_expires_in_s": round(float(r[16]), 2),
            "address": r[17]}
        out.append(summarize(tuple(r[:7]), (r[7], r[8]) if r[8] is not None else None,
                             r[9], r[10], (r[11], r[12]) if r[11] is not None else None,
                             r[13], running=owner is not None, default_route=default_route,
                             owner=owner))
    return out, len(rows) > limit


def pg_pages(url: str, session_id: str,
             page_size: int = 5000) -> Generator[list[dict[str, Any]], None, None]:
    """A session's recorded events read from PostgreSQL (no farm needs to run), a page at
    a time (bounded memory), in order; ``LookupError`` when there is no such session,
    ``StoreUnreadable`` when PostgreSQL cannot answer."""
    import psycopg

    from supervisor.facade import event_to_wire
    from supervisor.store.codec import decode
    from supervisor.store.records import EventRecord, SessionId, SubmissionId
    from supervisor.store.url import redact, scrub

    try:
        with psycopg.connect(url, connect_timeout=CONNECT_TIMEOUT_S,
                             application_name="corral-show",
                             options=f"-c statement_timeout={STATEMENT_TIMEOUT_MS}") as conn:
            conn.read_only = True
            conn.autocommit = True  # each page its own snapshot: never a long transaction
            row = conn.execute(b"SELECT sid FROM sessions WHERE session_id = %s",
                               (session_id,)).fetchone()
            if row is None:
                raise LookupError(session_id)
            after = 0
            while True:
                rows = conn.execute(
                    b"SELECT sequence, type, payload, submission_id, created_at FROM events"
                    b" WHERE sid = %s AND sequence > %s ORDER BY sequence LIMIT %s",
                    (row[0], after, page_size)).fetchall()
                yield [event_to_wire(EventRecord(
                    SessionId(session_id), int(seq), typ, decode(payload),
                    SubmissionId(sub) if sub is not None else None, created_at))
                    for seq, typ, payload, sub, created_at in rows]
                if len(rows) < page_size:
                    return
                after = int(rows[-1][0])
    except psycopg.Error as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StoreUnreadable(f"cannot read the session in PostgreSQL at {redact(url)}: "
                              f"{scrub(first, url)}") from None
