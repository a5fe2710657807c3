"""Read queries of the PostgreSQL store: the same reads, bounds and results as
``supervisor.store.reader`` (SQLite), as coroutines on one psycopg connection.

Invariants:
- Every multi-query read runs inside one REPEATABLE READ, READ ONLY transaction
  (``snapshot``), so it sees one committed state even while writers commit.
- Every query that can return many rows is bounded by a limit (the same ``MAX_PAGE_*``
  as SQLite) and reads one session's rows by primary-key range ``(sid, n)``.
- Results are built by the SQLite reader's own row converters where the row shapes are
  the same (``to_session``), so both stores return equal records.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from psycopg.pq import TransactionStatus

from supervisor.store.codec import decode
from supervisor.store.errors import InvalidRequest
from supervisor.store.pg.schema import Conn
from supervisor.store.reader import (
    MAX_PAGE_BATCHES,
    MAX_PAGE_EVENTS,
    MAX_PAGE_EXECUTIONS,
    MAX_PAGE_SESSIONS,
    SESSION_COLUMNS,
    check_limit,
    to_session,
)
from supervisor.store.records import (
    CheckpointState,
    EventRecord,
    ExecutionRecord,
    LoadedSession,
    Page,
    SessionId,
    SessionRecord,
    SubmissionId,
    TranscriptBatch,
    TurnId,
)
from supervisor.store.schema import KEY_LIMIT


def check_n(n: int, what: str = "sequence") -> int:
    """The SQLite store's range for sequences and epochs, kept on PostgreSQL too."""
    if not 0 <= n < KEY_LIMIT:
        raise InvalidRequest(f"{what} {n} out of range [0, 2**32)")
    return n


@contextlib.asynccontextmanager
async def snapshot(conn: Conn) -> AsyncIterator[None]:
    """A read-only snapshot transaction (nothing when already inside a transaction)."""
    if conn.info.transaction_status != TransactionStatus.IDLE:
        yield
        return
    await conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
    try:
        yield
    finally:
        if conn.info.transaction_status != TransactionStatus.IDLE and not conn.closed:
            await conn.execute("COMMIT")


async def one(conn: Conn, query: str, params: tuple[Any, ...] = ()) -> tuple[Any, ...] | None:
    cur = await conn.execute(query.encode(), params)
    return await cur.fetchone()


async def all_rows(conn: Conn, query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    cur = await conn.execute(query.encode(), params)
    return await cur.fetchall()


async def session_row(conn: Conn, session_id: str) -> tuple[Any, ...] | None:
    return await one(conn, f"SELECT {SESSION_COLUMNS} FROM sessions WHERE session_id = %s",
                     (session_id,))


async def sid_of(conn: Conn, session_id: str) -> int | None:
    row = await one(conn, "SELECT sid FROM sessions WHERE session_id = %s", (session_id,))
    return int(row[0]) if row else None


_LAST = {
    "events": "SELECT sequence FROM events WHERE sid = %s ORDER BY sequence DESC LIMIT 1",
    "transcript_batches": "SELECT sequence FROM transcript_batches WHERE sid = %s"
                          " ORDER BY sequence DESC LIMIT 1",
    "context_rewrites": "SELECT epoch FROM context_rewrites WHERE sid = %s"
                        " ORDER BY epoch DESC LIMIT 1",
}


async def last_sequence(conn: Conn, table: str, sid: int) -> int:
    """The highest sequence (or epoch) stored for the session in a keyed table; 0 if none."""
    row = await one(conn, _LAST[table], (sid,))
    return int(row[0]) if row else 0


async def load_state(conn: Conn, sid: int) -> CheckpointState:
    row = await one(conn, "SELECT state FROM checkpoint_state WHERE sid = %s", (sid,))
    return CheckpointState.from_json(decode(row[0])) if row else CheckpointState()


async def context_at(conn: Conn, sid: int, upto_batch: int | None = None,
                     epoch: int | None = None) -> tuple[list[dict[str, Any]], int]:
    """The context right after batch ``upto_batch`` (None: now), and its epoch; the rules
    of ``supervisor.store.reader.context_at``."""
    last = KEY_LIMIT - 1 if upto_batch is None else check_n(upto_batch)
    cols = "SELECT epoch, at_batch, items FROM context_rewrites WHERE sid = %s"
    if epoch is not None:
        row = await one(conn, f"{cols} AND epoch = %s", (sid, check_n(epoch, "epoch")))
        if row is None and epoch != 0:
            raise InvalidRequest(f"no context rewrite for epoch {epoch}")
        if row is not None and upto_batch is not None and row[1] > upto_batch:
            raise InvalidRequest(f"epoch {epoch} starts after batch {upto_batch}")
    elif upto_batch is None:
        row = await one(conn, f"{cols} ORDER BY epoch DESC LIMIT 1", (sid,))
    else:
        row = await one(conn, f"{cols} AND at_batch < %s ORDER BY epoch DESC LIMIT 1",
                        (sid, max(upto_batch, 1)))
    items: list[dict[str, Any]] = []
    found_epoch = 0
    after = 0
    if row is not None:
        found_epoch, after, rewrite_items = row
        items.extend(decode(rewrite_items))
    for (batch_items,) in await all_rows(
        conn, "SELECT items FROM transcript_batches WHERE sid = %s AND sequence > %s"
        " AND sequence <= %s ORDER BY sequence", (sid, after, last),
    ):
        items.extend(decode(batch_items))
    return items, int(found_epoch)


async def context_of(conn: Conn, session_id: str, upto_batch: int,
                     epoch: int | None) -> list[dict[str, Any]] | None:
    async with snapshot(conn):
        sid = await sid_of(conn, session_id)
        if sid is None:
            return None
        if upto_batch < 0 or upto_batch > await last_sequence(conn, "transcript_batches", sid):
            raise InvalidRequest(f"session {session_id!r} has no batch {upto_batch}")
        items, _ = await context_at(conn, sid, upto_batch, epoch)
        return items


_LOAD = (
    f"WITH s AS (SELECT {SESSION_COLUMNS} FROM sessions WHERE session_id = %s),"
    " r AS (SELECT epoch, at_batch, items FROM context_rewrites"
    " WHERE sid = (SELECT sid FROM s) ORDER BY epoch DESC LIMIT 1)"
    f" SELECT {', '.join('s.' + c.strip() for c in SESSION_COLUMNS.split(','))},"
    " (SELECT state FROM checkpoint_state c WHERE c.sid = s.sid),"
    " COALESCE((SELECT e.sequence FROM events e WHERE e.sid = s.sid"
    " ORDER BY e.sequence DESC LIMIT 1), 0),"
    " COALESCE((SELECT b.sequence FROM transcript_batches b WHERE b.sid = s.sid"
    " ORDER BY b.sequence DESC LIMIT 1), 0),"
    " (SELECT items FROM r),"
    " ARRAY(SELECT b.items FROM transcript_batches b WHERE b.sid = s.sid"
    " AND b.sequence > COALESCE((SELECT at_batch FROM r), 0) ORDER BY b.sequence)"
    " FROM s"
)


async def load(conn: Conn, session_id: str) -> LoadedSession | None:
    """The session, its state and its current context in ONE statement (one snapshot,
    one round trip: a takeover loads many sessions, and each round trip counts)."""
    row = await one(conn, _LOAD, (session_id,))
    if row is None:
        return None
    n = len(SESSION_COLUMNS.split(","))
    state, last_event, last_batch, rewrite_items, batch_items = row[n:]
    context: list[dict[str, Any]] = []
    if rewrite_items is not None:
        context.extend(decode(rewrite_items))
    for items in batch_items:
        context.extend(decode(items))
    return LoadedSession(
        record=to_session(row[:n]),
        state=CheckpointState.from_json(decode(state)) if state else CheckpointState(),
        context=context,
        last_event_sequence=int(last_event),
        last_batch_sequence=int(last_batch),
    )


async def get_session(conn: Conn, session_id: str) -> SessionRecord | None:
    row = await session_row(conn, session_id)
    return to_session(row) if row else None


async def active_sessions(conn: Conn) -> list[SessionId]:
    rows = await all_rows(conn, "SELECT session_id FROM sessions WHERE status = 'active'"
                                " ORDER BY session_id")
    return [SessionId(r[0]) for r in rows]


async def list_sessions(conn: Conn, after: str | None, limit: int) -> Page[SessionRecord]:
    check_limit(limit, MAX_PAGE_SESSIONS, "limit")
    # session_id is COLLATE "C" (schema): byte order, as SQLite's BINARY pages them.
    rows = await all_rows(
        conn, f"SELECT {SESSION_COLUMNS} FROM sessions WHERE session_id > %s"
        " ORDER BY session_id LIMIT %s", (after or "", limit + 1))
    more = len(rows) > limit
    records = [to_session(r) for r in rows[:limit]]
    return Page(records, records[-1].session_id if more else None)


async def transcript_page(conn: Conn, session_id: str, before_sequence: int | None,
                          max_batches: int) -> Page[TranscriptBatch]:
    check_limit(max_batches, MAX_PAGE_BATCHES, "max_batches")
    upper = KEY_LIMIT - 1 if before_sequence is None else check_n(before_sequence) - 1
    async with snapshot(conn):
        sid = await sid_of(conn, session_id)
        if sid is None:
            return Page([], None)
        rows = await all_rows(
            conn, "SELECT sequence, epoch, created_at, items FROM transcript_batches"
            " WHERE sid = %s AND sequence <= %s ORDER BY sequence DESC LIMIT %s",
            (sid, upper, max_batches + 1))
    more = len(rows) > max_batches
    batches = [
        TranscriptBatch(SessionId(session_id), seq, epoch, decode(items), created_at)
        for seq, epoch, created_at, items in reversed(rows[:max_batches])
    ]
    return Page(batches, batches[0].sequence if more else None)


async def events_page(conn: Conn, session_id: str, after_sequence: int,
                      limit: int) -> Page[EventRecord]:
    check_limit(limit, MAX_PAGE_EVENTS, "limit")
    check_n(after_sequence)
    # One statement (one snapshot, one round trip): a resumed turn pages its journal.
    rows = await all_rows(
        conn, "SELECT e.sequence, e.type, e.payload, e.submission_id, e.created_at"
        " FROM events e WHERE e.sid = (SELECT sid FROM sessions WHERE session_id = %s)"
        " AND e.sequence > %s ORDER BY e.sequence LIMIT %s",
        (session_id, after_sequence, limit + 1))
    more = len(rows) > limit
    events = [
        EventRecord(SessionId(session_id), seq, typ, decode(payload),
                    SubmissionId(sub) if sub is not None else None, created_at)
        for seq, typ, payload, sub, created_at in rows[:limit]
    ]
    return Page(events, events[-1].sequence if more else None)


async def executions_page(conn: Conn, session_id: str, before: str | None,
                          limit: int) -> Page[ExecutionRecord]:
    check_limit(limit, MAX_PAGE_EXECUTIONS, "limit")
    try:
        before_id = int(before) if before is not None else 1 << 62
    except ValueError as exc:
        raise InvalidRequest(f"bad executions cursor {before!r}") from exc
    async with snapshot(conn):
        sid = await sid_of(conn, session_id)
        if sid is None:
            return Page([], None)
        rows = await all_rows(
            conn, "SELECT id, turn_id, outcome, model_calls, tool_calls, failed_tool_calls,"
            " usage, started_at, ended_at, elapsed_s, sandbox_tier, reason FROM executions"
            " WHERE sid = %s AND id < %s ORDER BY id DESC LIMIT %s",
            (sid, before_id, limit + 1))
    more = len(rows) > limit
    records = [
        ExecutionRecord(
            session_id=SessionId(session_id), turn_id=TurnId(r[1]), outcome=r[2],
            model_calls=r[3], tool_calls=r[4], failed_tool_calls=r[5], usage=decode(r[6]),
            started_at=r[7], ended_at=r[8], elapsed_s=r[9], sandbox_tier=r[10], reason=r[11],
        )
        for r in rows[:limit]
    ]
    return Page(records, str(rows[limit - 1][0]) if more else None)
