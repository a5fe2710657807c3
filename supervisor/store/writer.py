"""Write transactions of the store: prepared steps, and the group applied in ONE
transaction on the writer connection (one thread hop per group).

A ``StepWrite`` is validated and encoded on the caller's side (``prepare_step``), so a
bad step fails alone and early. The writer thread then runs ``apply_group``: BEGIN
IMMEDIATE, one SAVEPOINT per operation, COMMIT. An operation that fails with a
``StoreError`` (unknown session, sequence conflict, ...) is rolled back to its savepoint
and reported to its own caller; the rest of the group still commits. A SQLite error
(busy, disk full, I/O) rolls the whole group back and fails every operation in it.

Invariants:
- Idempotent by key: events and batches are keyed (session, sequence), rewrites
  (session, epoch). Re-applying an identical row is a no-op; a row holding different
  content under the same key, or a sequence gap, is a ``SequenceConflict``.
- Sequences stay dense: an event/batch sequence must be the stored last + 1 (or an
  identical re-write of an existing one).
- The state row never goes backwards: it is replaced only when its
  ``next_event_sequence`` and ``next_batch_sequence`` are >= the stored ones, so a late
  re-commit of an old step cannot roll the state back. It may never claim a next
  sequence at or below one already stored.
- An execution record that reached a terminal outcome is never set back to "running".
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from supervisor.store import reader, slowdisk
from supervisor.store.codec import Limits, check_key, encode, encode_items, text_column
from supervisor.store.errors import (
    InvalidRequest,
    SequenceConflict,
    SessionExists,
    SessionNotFound,
    StoreError,
)
from supervisor.store.records import (
    EXECUTION_OUTCOMES,
    SESSION_ACTIVE,
    SESSION_STATUSES,
    CheckpointState,
    SessionId,
    SessionRecord,
    StepWrite,
)
from supervisor.store.schema import key, key_range


class Sids:
    """Cache of session_id -> sid. Only committed lookups are kept (sids never change)."""

    def __init__(self) -> None:
        self._known: dict[str, int] = {}
        self._tentative: dict[str, int] = {}

    def lookup(self, conn: sqlite3.Connection, session_id: str) -> int | None:
        sid = self._known.get(session_id) or self._tentative.get(session_id)
        if sid is None:
            row = conn.execute(
                "SELECT sid FROM sessions WHERE session_id = ?", (session_id,)
            ).fetchone()
            if row is None:
                return None
            sid = int(row[0])
            self._tentative[session_id] = sid
        return sid

    def require(self, conn: sqlite3.Connection, session_id: str) -> int:
        sid = self.lookup(conn, session_id)
        if sid is None:
            raise SessionNotFound(f"no session {session_id!r}")
        return sid

    def forget(self, session_id: str) -> None:
        """The session's rows are gone (deleted): its sid may be reused."""
        self._known.pop(session_id, None)
        self._tentative.pop(session_id, None)

    def mark(self) -> dict[str, int]:
        """A savepoint of the tentative lookups (restore with ``rolled_back_to``)."""
        return dict(self._tentative)

    def rolled_back_to(self, mark: dict[str, int]) -> None:
        # A lookup made inside a rolled-back savepoint may name a row that no longer
        # exists (a session created and rolled back); its sid could be reused.
        self._tentative = mark

    def committed(self) -> None:
        self._known.update(self._tentative)
        self._tentative.clear()

    def rolled_back(self) -> None:
        self._tentative.clear()


WriteOp = Callable[[sqlite3.Connection, Sids], Any]


@dataclass(frozen=True, slots=True)
class PreparedStep:
    session_id: str
    events: list[tuple[int, str, str | None, float, str]]  # seq, type, submission, at, payload
    batch: tuple[int, int, float, str] | None  # seq, epoch, created_at, items
    rewrite: tuple[int, int, str, str] | None  # epoch, at_batch, reasons, items
    state: tuple[int, int, str] | None  # next_event_sequence, next_batch_sequence, json
    execution: tuple[Any, ...] | None


def _positive(n: object, what: str) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InvalidRequest(f"{what} must be an integer >= 1, not {n!r}")
    return n


def prepare_step(step: StepWrite, limits: Limits) -> PreparedStep:
    """Validate and encode a step (caller side, before it joins a group)."""
    sid = step.session_id
    if not isinstance(sid, str) or not sid:
        raise InvalidRequest("step.session_id must be a non-empty string")
    check_key(sid, "step.session_id")
    if len(step.events) > limits.max_events_per_step:
        raise InvalidRequest(f"{len(step.events)} events in one step (max "
                             f"{limits.max_events_per_step})")
    events: list[tuple[int, str, str | None, float, str]] = []
    previous = None
    for ev in step.events:
        if ev.session_id != sid:
            raise InvalidRequest(f"event of session {ev.session_id!r} in a step of {sid!r}")
        seq = _positive(ev.sequence, "event sequence")
        if previous is not None and seq != previous + 1:
            raise SequenceConflict(f"events of one step must be consecutive ({previous}, {seq})")
        previous = seq
        if not isinstance(ev.type, str) or not ev.type:
            raise InvalidRequest("event type must be a non-empty string")
        check_key(ev.type, "event type")
        check_key(ev.submission_id, "submission_id")
        payload = encode(ev.payload, what=f"event {seq} payload",
                         limit=limits.max_payload_bytes)
        events.append((seq, ev.type, ev.submission_id, float(ev.created_at), payload))
    batch = None
    if step.append_batch is not None:
        b = step.append_batch
        if b.session_id != sid:
            raise InvalidRequest(f"batch of session {b.session_id!r} in a step of {sid!r}")
        items = encode_items(b.items, what=f"batch {b.sequence} items", limits=limits,
                             total_limit=limits.max_batch_bytes)
        batch = (_positive(b.sequence, "batch sequence"), int(b.epoch), float(b.created_at), items)
    rewrite = None
    if step.rewrite is not None:
        r = step.rewrite
        if not isinstance(r.epoch, int) or r.epoch < 0 or not isinstance(r.at_batch, int) \
                or r.at_batch < 0:
            raise InvalidRequest("rewrite epoch and at_batch must be integers >= 0")
        items = encode_items(r.items, what=f"rewrite {r.epoch} items", limits=limits,
                             total_limit=limits.max_rewrite_bytes)
        reasons = encode(list(r.reasons), what="rewrite reasons", limit=limits.max_payload_bytes)
        rewrite = (r.epoch, r.at_batch, reasons, items)
    state = None
    if step.state is not None:
        s = step.state
        text = encode(s.to_json(), what="checkpoint state", limit=limits.max_state_bytes)
        state = (_positive(s.next_event_sequence, "next_event_sequence"),
                 _positive(s.next_batch_sequence, "next_batch_sequence"), text)
    execution = None
    if step.execution is not None:
        x = step.execution
        if x.session_id != sid:
            raise InvalidRequest(f"execution of session {x.session_id!r} in a step of {sid!r}")
        check_key(x.turn_id, "execution turn_id")
        if x.outcome not in EXECUTION_OUTCOMES:
            raise InvalidRequest(f"execution outcome must be one of {EXECUTION_OUTCOMES}")
        execution = (
            x.turn_id, x.outcome, int(x.model_calls), int(x.tool_calls),
            int(x.failed_tool_calls),
            encode(x.usage, what="execution usage", limit=limits.max_payload_bytes),
            float(x.started_at), x.ended_at, x.elapsed_s, text_column(x.sandbox_tier),
            text_column(x.reason),
        )
    return PreparedStep(sid, events, batch, rewrite, state, execution)


def upsert_execution(values: str) -> str:
    """The executions upsert of every writer (SQLite, PostgreSQL, its one-statement
    step), around ``values`` (a VALUES list or a SELECT of the 12 columns): a terminal
    outcome is never set back to "running"."""
    return (
        "INSERT INTO executions (sid, turn_id, outcome, model_calls, tool_calls,"
        " failed_tool_calls, usage, started_at, ended_at, elapsed_s, sandbox_tier, reason) "
        + values
        + " ON CONFLICT (sid, turn_id) DO UPDATE SET outcome = excluded.outcome,"
        " model_calls = excluded.model_calls, tool_calls = excluded.tool_calls,"
        " failed_tool_calls = excluded.failed_tool_calls, usage = excluded.usage,"
        " started_at = excluded.started_at, ended_at = excluded.ended_at,"
        " elapsed_s = excluded.elapsed_s, sandbox_tier = excluded.sandbox_tier,"
        " reason = excluded.reason"
        " WHERE executions.outcome = 'running' OR excluded.outcome != 'running'"
    )


_UPSERT_EXECUTION = upsert_execution("VALUES (?,?,?,?,?,?,?,?,?,?,?,?)")


def apply_step(conn: sqlite3.Connection, sids: Sids, p: PreparedStep) -> None:
    sid = sids.require(conn, p.session_id)
    now = time.time()
    last_event = last_batch = None
    if p.events:
        last_event = reader.last_sequence(conn, "events", sid)
        for seq, typ, submission, created_at, payload in p.events:
            if seq <= last_event:
                row = conn.execute(
                    "SELECT type, payload, submission_id FROM events WHERE k = ?",
                    (key(sid, seq),),
                ).fetchone()
                if row != (typ, payload, submission):
                    raise SequenceConflict(
                        f"session {p.session_id!r} event {seq} already holds different content"
                    )
            elif seq == last_event + 1:
                conn.execute(
                    "INSERT INTO events (k, sequence, type, submission_id, created_at, payload)"
                    " VALUES (?,?,?,?,?,?)",
                    (key(sid, seq), seq, typ, submission, created_at, payload),
                )
                last_event = seq
            else:
                raise SequenceConflict(
                    f"session {p.session_id!r} event {seq} would leave a gap after {last_event}"
                )
    if p.batch is not None:
        seq, epoch, created_at, items = p.batch
        last_batch = reader.last_sequence(conn, "transcript_batches", sid)
        if seq <= last_batch:
            row = conn.execute(
                "SELECT epoch, items FROM transcript_batches WHERE k = ?", (key(sid, seq),)
            ).fetchone()
            if row != (epoch, items):
                raise SequenceConflict(
                    f"session {p.session_id!r} batch {seq} already holds different items"
                )
        elif seq == last_batch + 1:
            conn.execute(
                "INSERT INTO transcript_batches (k, sequence, epoch, created_at, items)"
                " VALUES (?,?,?,?,?)",
                (key(sid, seq), seq, epoch, created_at, items),
            )
            last_batch = seq
        else:
            raise SequenceConflict(
                f"session {p.session_id!r} batch {seq} would leave a gap after {last_batch}"
            )
    if p.rewrite is not None:
        _apply_rewrite(conn, sid, p.session_id, p.rewrite, now)
    if p.state is not None:
        _apply_state(conn, sid, p.session_id, p.state, last_event, last_batch, now)
    if p.execution is not None:
        conn.execute(_UPSERT_EXECUTION, (sid, *p.execution))


def _apply_rewrite(conn: sqlite3.Connection, sid: int, session_id: str,
                   rewrite: tuple[int, int, str, str], now: float) -> None:
    epoch, at_batch, reasons, items = rewrite
    last_epoch_row = conn.execute(
        "SELECT epoch FROM context_rewrites WHERE k BETWEEN ? AND ? ORDER BY k DESC LIMIT 1",
        key_range(sid),
    ).fetchone()
    if last_epoch_row is not None and epoch <= last_epoch_row[0]:
        row = conn.execute(
            "SELECT at_batch, reasons, items FROM context_rewrites WHERE k = ?",
            (key(sid, epoch),),
        ).fetchone()
        if row != (at_batch, reasons, items):
            raise SequenceConflict(
                f"session {session_id!r} rewrite epoch {epoch} is not above the last "
                f"epoch {last_epoch_row[0]} and differs from what is stored"
            )
        return
    if at_batch > reader.last_sequence(conn, "transcript_batches", sid):
        raise SequenceConflict(f"session {session_id!r} rewrite at_batch {at_batch} is past "
                               "the last batch")
    conn.execute(
        "INSERT INTO context_rewrites (k, epoch, at_batch, reasons, created_at, items)"
        " VALUES (?,?,?,?,?,?)",
        (key(sid, epoch), epoch, at_batch, reasons, now, items),
    )


def _apply_state(conn: sqlite3.Connection, sid: int, session_id: str,
                 state: tuple[int, int, str], last_event: int | None,
                 last_batch: int | None, now: float) -> None:
    next_event, next_batch, text = state
    stored = conn.execute(
        "SELECT next_event_sequence, next_batch_sequence FROM checkpoint_state WHERE sid = ?",
        (sid,),
    ).fetchone()
    if stored is not None and (next_event < stored[0] or next_batch < stored[1]):
        return  # a late re-commit of an older step: the newer state stays
    if last_event is None:
        last_event = reader.last_sequence(conn, "events", sid)
    if last_batch is None:
        last_batch = reader.last_sequence(conn, "transcript_batches", sid)
    if next_event <= last_event or next_batch <= last_batch:
        raise SequenceConflict(
            f"session {session_id!r} state says next event {next_event} / next batch "
            f"{next_batch}, but event {last_event} / batch {last_batch} are stored"
        )
    conn.execute(
        "INSERT OR REPLACE INTO checkpoint_state (sid, updated_at, next_event_sequence,"
        " next_batch_sequence, state) VALUES (?,?,?,?,?)",
        (sid, now, next_event, next_batch, text),
    )


def create_session(conn: sqlite3.Connection, sids: Sids, record: SessionRecord, config: str,
                   first: PreparedStep | None) -> None:
    """Insert the session row (and its first step). Re-creating an identical session is a
    no-op, so a cancelled create can be retried."""
    if record.status not in SESSION_STATUSES:
        raise InvalidRequest(f"status must be one of {SESSION_STATUSES}")
    existing = reader.session_row(conn, record.session_id)
    if existing is not None:
        if (existing[3], existing[4], existing[5]) != (
            config, record.parent_session_id, record.fork_sequence
        ):
            raise SessionExists(f"session {record.session_id!r} already exists")
    else:
        route = workspace = tenant = None
        cfg = record.config
        if isinstance(cfg, dict):
            route, workspace, tenant = (
                text_column(cfg.get("route")),
                text_column(cfg.get("workspace")),
                text_column(cfg.get("tenant")),
            )
        cursor = conn.execute(
            "INSERT INTO sessions (session_id, created_at, config, route, workspace, tenant,"
            " parent_session_id, fork_sequence, status) VALUES (?,?,?,?,?,?,?,?,?)",
            (record.session_id, record.created_at, config, route, workspace, tenant,
             record.parent_session_id, record.fork_sequence, record.status),
        )
        sid = int(cursor.lastrowid or 0)
        conn.execute(
            "INSERT INTO checkpoint_state (sid, updated_at, next_event_sequence,"
            " next_batch_sequence, state) VALUES (?,?,?,?,?)",
            (sid, time.time(), 1, 1, encode(CheckpointState().to_json(), what="state",
                                            limit=1 << 20)),
        )
    if first is not None:
        apply_step(conn, sids, first)


def set_status(conn: sqlite3.Connection, sids: Sids, session_id: str, status: str) -> None:
    if status not in SESSION_STATUSES:
        raise InvalidRequest(f"status must be one of {SESSION_STATUSES}, not {status!r}")
    sid = sids.require(conn, session_id)
    conn.execute("UPDATE sessions SET status = ? WHERE sid = ?", (status, sid))


# Every table holding a session's rows, keyed by rowid range (k) or by sid.
_KEYED_TABLES = ("transcript_batches", "context_rewrites", "events")
_SID_TABLES = ("executions", "checkpoint_state", "leases", "sessions")


def delete_session(conn: sqlite3.Connection, sids: Sids, session_id: str) -> None:
    """Remove every row of the session (``corral delete``), in one transaction."""
    sid = sids.require(conn, session_id)
    lo, hi = key_range(sid)
    for table in _KEYED_TABLES:
        conn.execute(f"DELETE FROM {table} WHERE k BETWEEN ? AND ?", (lo, hi))
    for table in _SID_TABLES:
        conn.execute(f"DELETE FROM {table} WHERE sid = ?", (sid,))
    sids.forget(session_id)


def fork(conn: sqlite3.Connection, sids: Sids, session_id: str, at_sequence: int,
         new_session_id: str, limits: Limits) -> SessionRecord:
    """Create ``new_session_id`` whose epoch-0 snapshot is the parent's context right after
    batch ``at_sequence`` was appended. Idempotent for an identical retry."""
    parent_row = reader.session_row(conn, session_id)
    if parent_row is None:
        raise SessionNotFound(f"no session {session_id!r}")
    parent_sid = int(parent_row[0])
    existing = reader.session_row(conn, new_session_id)
    if existing is not None:
        if existing[4] == session_id and existing[5] == at_sequence:
            return reader.to_session(existing)
        raise SessionExists(f"session {new_session_id!r} already exists")
    last = reader.last_sequence(conn, "transcript_batches", parent_sid)
    if not isinstance(at_sequence, int) or not 0 <= at_sequence <= last:
        raise InvalidRequest(f"fork at batch {at_sequence!r}: session {session_id!r} has "
                             f"batches 1..{last}")
    context, _ = reader.context_at(conn, parent_sid, at_sequence)
    parent_state = reader.load_state(conn, parent_sid)
    record = SessionRecord(
        session_id=SessionId(new_session_id),
        created_at=time.time(),
        config=reader.to_session(parent_row).config,
        parent_session_id=SessionId(session_id),
        fork_sequence=at_sequence,
        status=SESSION_ACTIVE,
    )
    state = CheckpointState(
        route=parent_state.route,
        last_rewrite={"epoch": 0, "reasons": ["fork"], "at_batch": 0},
    )
    create_session(conn, sids, record, parent_row[3], None)
    new_sid = sids.require(conn, new_session_id)
    conn.execute(
        "INSERT INTO context_rewrites (k, epoch, at_batch, reasons, created_at, items)"
        " VALUES (?,?,?,?,?,?)",
        (key(new_sid, 0), 0, 0, '["fork"]', time.time(),
         encode_items(context, what="fork context", limits=limits,
                      total_limit=limits.max_rewrite_bytes)),
    )
    conn.execute(
        "UPDATE checkpoint_state SET state = ? WHERE sid = ?",
        (encode(state.to_json(), what="state", limit=limits.max_state_bytes), new_sid),
    )
    return record


def apply_group(
    conn: sqlite3.Connection, sids: Sids, ops: Sequence[WriteOp]
) -> list[tuple[bool, Any]]:
    """Run ``ops`` in ONE transaction; each gets (True, result) or (False, StoreError)."""
    results: list[tuple[bool, Any]] = []
    conn.execute("BEGIN IMMEDIATE")
    try:
        for op in ops:
            conn.execute("SAVEPOINT op")
            mark = sids.mark()
            try:
                value = op(conn, sids)
            except StoreError as exc:
                conn.execute("ROLLBACK TO op")
                conn.execute("RELEASE op")
                sids.rolled_back_to(mark)
                results.append((False, exc))
            else:
                conn.execute("RELEASE op")
                results.append((True, value))
        slowdisk.stall()  # chaos only: off unless CORRAL_CHAOS_STORE_DELAY_S is set
        conn.execute("COMMIT")
    except BaseException:
        sids.rolled_back()
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    sids.committed()
    return results
