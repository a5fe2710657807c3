"""Read queries of the store: loading a session, pages, replay. Synchronous functions
that run on the store's reader (or writer) connection thread, one call per hop.

Invariants:
- Every multi-query read runs inside one read transaction (``snapshot``), so it sees
  one committed state of the database even while the writer commits.
- Every query that can return many rows is bounded by a limit (pages) and reads one
  session's rows by rowid range (see ``schema.key``), never a table scan.
- Context = the newest rewrite snapshot's items + the items of every batch whose
  sequence is above that rewrite's ``at_batch``, in sequence order. Without any
  rewrite, all batches (epoch 0).
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from typing import Any

from supervisor.store.codec import decode
from supervisor.store.errors import InvalidRequest
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
from supervisor.store.schema import KEY_LIMIT, key, key_range

MAX_PAGE_BATCHES = 1000
MAX_PAGE_EVENTS = 5000
MAX_PAGE_EXECUTIONS = 1000
MAX_PAGE_SESSIONS = 1000
_MASK = KEY_LIMIT - 1

SESSION_COLUMNS = (
    "sid, session_id, created_at, config, parent_session_id, fork_sequence, status"
)


@contextlib.contextmanager
def snapshot(conn: sqlite3.Connection) -> Iterator[None]:
    """A read transaction (or nothing, when already inside the writer's transaction)."""
    if conn.in_transaction:
        yield
        return
    conn.execute("BEGIN")
    try:
        yield
    finally:
        if conn.in_transaction:
            conn.execute("COMMIT")


def check_limit(value: int, upper: int, what: str) -> int:
    if not isinstance(value, int) or not 1 <= value <= upper:
        raise InvalidRequest(f"{what} must be an integer in [1, {upper}], not {value!r}")
    return value


def session_row(conn: sqlite3.Connection, session_id: str) -> tuple[Any, ...] | None:
    row: tuple[Any, ...] | None = conn.execute(
        f"SELECT {SESSION_COLUMNS} FROM sessions WHERE session_id = ?", (session_id,)
    ).fetchone()
    return row


def to_session(row: tuple[Any, ...]) -> SessionRecord:
    _, session_id, created_at, config, parent, fork_sequence, status = row
    return SessionRecord(
        session_id=SessionId(session_id),
        created_at=created_at,
        config=decode(config),
        parent_session_id=SessionId(parent) if parent is not None else None,
        fork_sequence=fork_sequence,
        status=status,
    )


def last_sequence(conn: sqlite3.Connection, table: str, sid: int) -> int:
    """The highest sequence (or epoch) stored for the session in a keyed table; 0 if none."""
    lo, hi = key_range(sid)
    row = conn.execute(
        f"SELECT k FROM {table} WHERE k BETWEEN ? AND ? ORDER BY k DESC LIMIT 1", (lo, hi)
    ).fetchone()
    return int(row[0]) & _MASK if row else 0


def load_state(conn: sqlite3.Connection, sid: int) -> CheckpointState:
    row = conn.execute("SELECT state FROM checkpoint_state WHERE sid = ?", (sid,)).fetchone()
    return CheckpointState.from_json(decode(row[0])) if row else CheckpointState()


def context_at(
    conn: sqlite3.Connection, sid: int, upto_batch: int | None = None,
    epoch: int | None = None,
) -> tuple[list[dict[str, Any]], int]:
    """The context right after batch ``upto_batch`` was appended (None: now), and its epoch.

    With ``epoch``, the context of exactly that epoch (its rewrite, or none for epoch 0
    without one) plus the batches after the rewrite up to ``upto_batch``; otherwise the
    newest rewrite taken before that batch was appended, plus the batches up to it.
    """
    lo, hi = key_range(sid)
    last = hi if upto_batch is None else key(sid, upto_batch)
    if epoch is not None:
        row = conn.execute(
            "SELECT epoch, at_batch, items FROM context_rewrites WHERE k = ?", (key(sid, epoch),)
        ).fetchone()
        if row is None and epoch != 0:
            raise InvalidRequest(f"no context rewrite for epoch {epoch}")
        if row is not None and upto_batch is not None and row[1] > upto_batch:
            raise InvalidRequest(f"epoch {epoch} starts after batch {upto_batch}")
    elif upto_batch is None:
        row = conn.execute(
            "SELECT epoch, at_batch, items FROM context_rewrites WHERE k BETWEEN ? AND ?"
            " ORDER BY k DESC LIMIT 1",
            (lo, hi),
        ).fetchone()
    else:
        # A rewrite with at_batch = k was taken when batch k was the last one, so those
        # with at_batch < upto_batch precede the batch; one with at_batch == upto_batch
        # came after it (a snapshot at_batch 0 precedes everything).
        row = conn.execute(
            "SELECT epoch, at_batch, items FROM context_rewrites WHERE k BETWEEN ? AND ?"
            " AND at_batch < ? ORDER BY k DESC LIMIT 1",
            (lo, hi, max(upto_batch, 1)),
        ).fetchone()
    items: list[dict[str, Any]] = []
    found_epoch = 0
    after = lo
    if row is not None:
        found_epoch, at_batch, rewrite_items = row
        items.extend(decode(rewrite_items))
        after = key(sid, at_batch)
    for (batch_items,) in conn.execute(
        "SELECT items FROM transcript_batches WHERE k > ? AND k <= ? ORDER BY k", (after, last)
    ):
        items.extend(decode(batch_items))
    return items, int(found_epoch)


def context_of(conn: sqlite3.Connection, session_id: str, upto_batch: int,
               epoch: int | None) -> list[dict[str, Any]] | None:
    with snapshot(conn):
        sid = _sid(conn, session_id)
        if sid is None:
            return None
        if upto_batch < 0 or upto_batch > last_sequence(conn, "transcript_batches", sid):
            raise InvalidRequest(f"session {session_id!r} has no batch {upto_batch}")
        items, _ = context_at(conn, sid, upto_batch, epoch)
        return items


def load(conn: sqlite3.Connection, session_id: str) -> LoadedSession | None:
    with snapshot(conn):
        row = session_row(conn, session_id)
        if row is None:
            return None
        sid = int(row[0])
        context, _ = context_at(conn, sid)
        return LoadedSession(
            record=to_session(row),
            state=load_state(conn, sid),
            context=context,
            last_event_sequence=last_sequence(conn, "events", sid),
            last_batch_sequence=last_sequence(conn, "transcript_batches", sid),
        )


def get_session(conn: sqlite3.Connection, session_id: str) -> SessionRecord | None:
    row = session_row(conn, session_id)
    return to_session(row) if row else None


def active_sessions(conn: sqlite3.Connection) -> list[SessionId]:
    rows = conn.execute(
        "SELECT session_id FROM sessions WHERE status = 'active' ORDER BY session_id"
    ).fetchall()
    return [SessionId(r[0]) for r in rows]


def list_sessions(conn: sqlite3.Connection, after: str | None, limit: int) -> Page[SessionRecord]:
    check_limit(limit, MAX_PAGE_SESSIONS, "limit")
    rows = conn.execute(
        f"SELECT {SESSION_COLUMNS} FROM sessions WHERE session_id > ? ORDER BY session_id LIMIT ?",
        (after or "", limit + 1),
    ).fetchall()
    more = len(rows) > limit
    records = [to_session(r) for r in rows[:limit]]
    return Page(records, records[-1].session_id if more else None)


def _sid(conn: sqlite3.Connection, session_id: str) -> int | None:
    row = conn.execute("SELECT sid FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
    return int(row[0]) if row else None


def transcript_page(
    conn: sqlite3.Connection, session_id: str, before_sequence: int | None, max_batches: int
) -> Page[TranscriptBatch]:
    """Up to ``max_batches`` batches before ``before_sequence`` (newest first selection),
    returned in chronological order; ``next_cursor`` is the ``before_sequence`` of the
    next older page."""
    check_limit(max_batches, MAX_PAGE_BATCHES, "max_batches")
    with snapshot(conn):
        sid = _sid(conn, session_id)
        if sid is None:
            return Page([], None)
        lo, hi = key_range(sid)
        upper = hi if before_sequence is None else key(sid, before_sequence) - 1
        rows = conn.execute(
            "SELECT sequence, epoch, created_at, items FROM transcript_batches"
            " WHERE k >= ? AND k <= ? ORDER BY k DESC LIMIT ?",
            (lo, upper, max_batches + 1),
        ).fetchall()
    more = len(rows) > max_batches
    batches = [
        TranscriptBatch(SessionId(session_id), seq, epoch, decode(items), created_at)
        for seq, epoch, created_at, items in reversed(rows[:max_batches])
    ]
    return Page(batches, batches[0].sequence if more else None)


def events_page(
    conn: sqlite3.Connection, session_id: str, after_sequence: int, limit: int
) -> Page[EventRecord]:
    """Up to ``limit`` events after ``after_sequence``, ascending; ``next_cursor`` is the
    ``after_sequence`` of the next page."""
    check_limit(limit, MAX_PAGE_EVENTS, "limit")
    with snapshot(conn):
        sid = _sid(conn, session_id)
        if sid is None:
            return Page([], None)
        _, hi = key_range(sid)
        rows = conn.execute(
            "SELECT sequence, type, payload, submission_id, created_at FROM events"
            " WHERE k > ? AND k <= ? ORDER BY k LIMIT ?",
            (key(sid, after_sequence), hi, limit + 1),
        ).fetchall()
    more = len(rows) > limit
    events = [
        EventRecord(
            SessionId(session_id),
            seq,
            typ,
            decode(payload),
            SubmissionId(sub) if sub is not None else None,
            created_at,
        )
        for seq, typ, payload, sub, created_at in rows[:limit]
    ]
    return Page(events, events[-1].sequence if more else None)


def executions_page(
    conn: sqlite3.Connection, session_id: str, before: str | None, limit: int
) -> Page[ExecutionRecord]:
    """Up to ``limit`` execution records, newest first; ``next_cursor`` (opaque str) is the
    ``before`` of the next older page."""
    check_limit(limit, MAX_PAGE_EXECUTIONS, "limit")
    try:
        before_id = int(before) if before is not None else 1 << 62
    except ValueError as exc:
        raise InvalidRequest(f"bad executions cursor {before!r}") from exc
    with snapshot(conn):
        sid = _sid(conn, session_id)
        if sid is None:
            return Page([], None)
        rows = conn.execute(
            "SELECT id, turn_id, outcome, model_calls, tool_calls, failed_tool_calls, usage,"
            " started_at, ended_at, elapsed_s, sandbox_tier, reason FROM executions"
            " WHERE sid = ? AND id < ? ORDER BY id DESC LIMIT ?",
            (sid, before_id, limit + 1),
        ).fetchall()
    more = len(rows) > limit
    records = [
        ExecutionRecord(
            session_id=SessionId(session_id),
            turn_id=TurnId(r[1]),
            outcome=r[2],
            model_calls=r[3],
            tool_calls=r[4],
            failed_tool_calls=r[5],
            usage=decode(r[6]),
            started_at=r[7],
            ended_at=r[8],
            elapsed_s=r[9],
            sandbox_tier=r[10],
            reason=r[11],
        )
        for r in rows[:limit]
    ]
    return Page(records, str(rows[limit - 1][0]) if more else None)
