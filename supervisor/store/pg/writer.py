"""Write transactions of the PostgreSQL store: the rules of ``supervisor.store.writer``
(SQLite), as coroutines on the writer connection.

Steps are validated and encoded by the shared ``writer.prepare_step`` on the caller's
side. ``apply_group`` runs a group in ONE transaction with one SAVEPOINT per operation:
an operation failing with a ``StoreError`` (or a statement error of its own: a NUL byte,
a concurrent writer's row) is rolled back alone and reported to its caller; a broken
connection or a failed COMMIT fails the whole group.

Invariants (the SQLite writer's, kept with PostgreSQL's keys):
- Idempotent by key (session, sequence) / (session, epoch): an identical re-write is a
  no-op, different content or a gap is ``SequenceConflict``.
- Sequences stay dense; the state row never goes backwards. The no-regression guard is
  also in the upsert's ``WHERE``, so it holds against a concurrent writer on another
  connection (it is evaluated on the newest row version, under its row lock).
- A concurrent writer inserting the same key first (a unique violation) makes the
  operation roll back to its savepoint and run once more, now seeing that row: the
  second writer then gets the same no-op or conflict it would have got serially.
- An execution that reached a terminal outcome is never set back to "running".
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import psycopg
from psycopg import errors as pgerr

from supervisor.store.codec import Limits, encode, encode_items, text_column
from supervisor.store.errors import (
    InvalidRequest,
    SequenceConflict,
    SessionExists,
    SessionNotFound,
    StoreError,
)
from supervisor.store.pg import onestep, reader
from supervisor.store.pg.reader import check_n, one
from supervisor.store.pg.schema import Conn
from supervisor.store.reader import to_session
from supervisor.store.records import (
    SESSION_ACTIVE,
    SESSION_STATUSES,
    CheckpointState,
    SessionId,
    SessionRecord,
)
from supervisor.store.writer import PreparedStep, upsert_execution

PgOp = Callable[[Conn], Awaitable[Any]]
_OP_TRIES = 3
_UPSERT_EXECUTION = upsert_execution("VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s)")


async def require_sid(conn: Conn, session_id: str) -> int:
    sid = await reader.sid_of(conn, session_id)
    if sid is None:
        raise SessionNotFound(f"no session {session_id!r}")
    return sid


_PREFETCH = (
    "SELECT s.sid,"
    " COALESCE((SELECT e.sequence FROM events e WHERE e.sid = s.sid"
    " ORDER BY e.sequence DESC LIMIT 1), 0),"
    " COALESCE((SELECT b.sequence FROM transcript_batches b WHERE b.sid = s.sid"
    " ORDER BY b.sequence DESC LIMIT 1), 0),"
    " c.next_event_sequence, c.next_batch_sequence"
    " FROM sessions s LEFT JOIN checkpoint_state c ON c.sid = s.sid WHERE s.session_id = %s"
)


_INSERT = ("INSERT INTO events (sid, sequence, type, submission_id, created_at, payload)"
           " VALUES (%s,%s,%s,%s,%s,%s)")
_INSERT_LEASED = ("INSERT INTO events (sid, sequence, type, submission_id, created_at, payload,"
                  " lease_owner, lease_epoch) VALUES (%s,%s,%s,%s,%s,%s,%s,%s)")


async def apply_step(conn: Conn, p: PreparedStep,
                     fence: tuple[str, int] | None = None) -> None:
    """Write one prepared step; its new events record ``fence``, the lease (owner,
    epoch) the write was made under (None without leases)."""
    # One round trip for everything the checks need (sid, last event, last batch, the
    # stored state's counters): the writer's cost is its sequential round trips.
    head = await one(conn, _PREFETCH, (p.session_id,))
    if head is None:
        raise SessionNotFound(f"no session {p.session_id!r}")
    sid, last_event, last_batch = int(head[0]), int(head[1]), int(head[2])
    stored = (head[3], head[4]) if head[3] is not None else None
    now = time.time()
    if p.events:
        new: list[tuple[Any, ...]] = []
        lease = fence if fence is not None else ()
        for seq, typ, submission, created_at, payload in p.events:
            check_n(seq)
            if seq <= last_event:
                row = await one(conn, "SELECT type, payload, submission_id FROM events"
                                " WHERE sid = %s AND sequence = %s", (sid, seq))
                if row != (typ, payload, submission):
                    raise SequenceConflict(
                        f"session {p.session_id!r} event {seq} already holds different content"
                    )
            elif seq == last_event + 1:
                new.append((sid, seq, typ, submission, created_at, payload, *lease))
                last_event = seq
            else:
                raise SequenceConflict(
                    f"session {p.session_id!r} event {seq} would leave a gap after {last_event}"
                )
        if new:
            async with conn.cursor() as cur:
                await cur.executemany(_INSERT_LEASED if fence is not None else _INSERT, new)
    if p.batch is not None:
        seq, epoch, created_at, items = p.batch
        check_n(seq)
        if seq <= last_batch:
            row = await one(conn, "SELECT epoch, items FROM transcript_batches"
                            " WHERE sid = %s AND sequence = %s", (sid, seq))
            if row != (epoch, items):
                raise SequenceConflict(
                    f"session {p.session_id!r} batch {seq} already holds different items"
                )
        elif seq == last_batch + 1:
            await conn.execute(
                "INSERT INTO transcript_batches (sid, sequence, epoch, created_at, items)"
                " VALUES (%s,%s,%s,%s,%s)", (sid, seq, epoch, created_at, items))
            last_batch = seq
        else:
            raise SequenceConflict(
                f"session {p.session_id!r} batch {seq} would leave a gap after {last_batch}"
            )
    if p.rewrite is not None:
        await _apply_rewrite(conn, sid, p.session_id, p.rewrite, last_batch, now)
    if p.state is not None:
        await _apply_state(conn, sid, p.session_id, p.state, stored, last_event, last_batch,
                           now)
    if p.execution is not None:
        await conn.execute(_UPSERT_EXECUTION, (sid, *p.execution))


async def _apply_rewrite(conn: Conn, sid: int, session_id: str,
                         rewrite: tuple[int, int, str, str], last_batch: int,
                         now: float) -> None:
    epoch, at_batch, reasons, items = rewrite
    check_n(epoch, "epoch")
    last_epoch = await one(conn, "SELECT epoch FROM context_rewrites WHERE sid = %s"
                           " ORDER BY epoch DESC LIMIT 1", (sid,))
    if last_epoch is not None and epoch <= last_epoch[0]:
        row = await one(conn, "SELECT at_batch, reasons, items FROM context_rewrites"
                        " WHERE sid = %s AND epoch = %s", (sid, epoch))
        if row != (at_batch, reasons, items):
            raise SequenceConflict(
                f"session {session_id!r} rewrite epoch {epoch} is not above the last "
                f"epoch {last_epoch[0]} and differs from what is stored"
            )
        return
    if at_batch > last_batch:
        raise SequenceConflict(f"session {session_id!r} rewrite at_batch {at_batch} is past "
                               "the last batch")
    await conn.execute(
        "INSERT INTO context_rewrites (sid, epoch, at_batch, reasons, created_at, items)"
        " VALUES (%s,%s,%s,%s,%s,%s)", (sid, epoch, at_batch, reasons, now, items))


async def _apply_state(conn: Conn, sid: int, session_id: str, state: tuple[int, int, str],
                       stored: tuple[int, int] | None, last_event: int, last_batch: int,
                       now: float) -> None:
    next_event, next_batch, text = state
    if stored is not None and (next_event < stored[0] or next_batch < stored[1]):
        return  # a late re-commit of an older step: the newer state stays
    if next_event <= last_event or next_batch <= last_batch:
        raise SequenceConflict(
            f"session {session_id!r} state says next event {next_event} / next batch "
            f"{next_batch}, but event {last_event} / batch {last_batch} are stored"
        )
    await conn.execute(
        "INSERT INTO checkpoint_state (sid, updated_at, next_event_sequence,"
        " next_batch_sequence, state) VALUES (%s,%s,%s,%s,%s)"
        " ON CONFLICT (sid) DO UPDATE SET updated_at = excluded.updated_at,"
        " next_event_sequence = excluded.next_event_sequence,"
        " next_batch_sequence = excluded.next_batch_sequence, state = excluded.state"
        " WHERE checkpoint_state.next_event_sequence <= excluded.next_event_sequence"
        " AND checkpoint_state.next_batch_sequence <= excluded.next_batch_sequence",
        (sid, now, next_event, next_batch, text),
    )


async def create_session(conn: Conn, record: SessionRecord, config: str,
                         first: PreparedStep | None) -> None:
    """Insert the session row (and its first step); an identical re-create is a no-op."""
    if record.status not in SESSION_STATUSES:
        raise InvalidRequest(f"status must be one of {SESSION_STATUSES}")
    existing = await reader.session_row(conn, record.session_id)
    if existing is not None:
        if (existing[3], existing[4], existing[5]) != (
            config, record.parent_session_id, record.fork_sequence
        ):
            raise SessionExists(f"session {record.session_id!r} already exists")
    else:
        cfg = record.config if isinstance(record.config, dict) else {}
        route, workspace, tenant = (
            text_column(v) for v in (cfg.get("route"), cfg.get("workspace"), cfg.get("tenant"))
        )
        row = await one(
            conn, "INSERT INTO sessions (session_id, created_at, config, route, workspace,"
            " tenant, parent_session_id, fork_sequence, status)"
            " VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s) RETURNING sid",
            (record.session_id, record.created_at, config, route, workspace, tenant,
             record.parent_session_id, record.fork_sequence, record.status))
        if row is None:  # pragma: no cover - RETURNING always gives the row
            raise StoreError("creating a session returned no row")
        await conn.execute(
            "INSERT INTO checkpoint_state (sid, updated_at, next_event_sequence,"
            " next_batch_sequence, state) VALUES (%s,%s,%s,%s,%s)",
            (row[0], time.time(), 1, 1,
             encode(CheckpointState().to_json(), what="state", limit=1 << 20)))
    if first is not None:
        await apply_step(conn, first)


async def set_status(conn: Conn, session_id: str, status: str) -> None:
    if status not in SESSION_STATUSES:
        raise InvalidRequest(f"status must be one of {SESSION_STATUSES}, not {status!r}")
    sid = await require_sid(conn, session_id)
    await conn.execute("UPDATE sessions SET status = %s WHERE sid = %s", (status, sid))


_SESSION_TABLES = ("transcript_batches", "context_rewrites", "events", "executions",
                   "checkpoint_state", "leases", "sessions")


async def delete_session(conn: Conn, session_id: str) -> None:
    """Remove every row of the session, in one transaction."""
    sid = await require_sid(conn, session_id)
    for table in _SESSION_TABLES:
        await conn.execute(f"DELETE FROM {table} WHERE sid = %s".encode(), (sid,))


async def fork(conn: Conn, session_id: str, at_sequence: int, new_session_id: str,
               limits: Limits) -> SessionRecord:
    """``writer.fork`` of the SQLite store: the parent's context after ``at_sequence`` as
    the epoch-0 snapshot of a new session. Idempotent for an identical retry."""
    parent_row = await reader.session_row(conn, session_id)
    if parent_row is None:
        raise SessionNotFound(f"no session {session_id!r}")
    parent_sid = int(parent_row[0])
    existing = await reader.session_row(conn, new_session_id)
    if existing is not None:
        if existing[4] == session_id and existing[5] == at_sequence:
            return to_session(existing)
        raise SessionExists(f"session {new_session_id!r} already exists")
    last = await reader.last_sequence(conn, "transcript_batches", parent_sid)
    if not isinstance(at_sequence, int) or not 0 <= at_sequence <= last:
        raise InvalidRequest(f"fork at batch {at_sequence!r}: session {session_id!r} has "
                             f"batches 1..{last}")
    context, _ = await reader.context_at(conn, parent_sid, at_sequence)
    parent_state = await reader.load_state(conn, parent_sid)
    record = SessionRecord(
        session_id=SessionId(new_session_id), created_at=time.time(),
        config=to_session(parent_row).config, parent_session_id=SessionId(session_id),
        fork_sequence=at_sequence, status=SESSION_ACTIVE,
    )
    state = CheckpointState(
        route=parent_state.route,
        last_rewrite={"epoch": 0, "reasons": ["fork"], "at_batch": 0},
    )
    await create_session(conn, record, parent_row[3], None)
    new_sid = await require_sid(conn, new_session_id)
    await conn.execute(
        "INSERT INTO context_rewrites (sid, epoch, at_batch, reasons, created_at, items)"
        " VALUES (%s,%s,%s,%s,%s,%s)",
        (new_sid, 0, 0, '["fork"]', time.time(),
         encode_items(context, what="fork context", limits=limits,
                      total_limit=limits.max_rewrite_bytes)))
    await conn.execute(
        "UPDATE checkpoint_state SET state = %s WHERE sid = %s",
        (encode(state.to_json(), what="state", limit=limits.max_state_bytes), new_sid))
    return record


async def _run_op(conn: Conn, op: PgOp) -> tuple[bool, Any]:
    """One operation under its own savepoint: (True, value) or (False, StoreError)."""
    for attempt in range(_OP_TRIES):
        try:
            async with conn.transaction():  # a SAVEPOINT inside the group's transaction
                return True, await op(conn)
        except StoreError as exc:
            return False, exc
        except pgerr.UniqueViolation as exc:
            # Another connection inserted the same key first; run again to see its row.
            if attempt + 1 == _OP_TRIES:
                return False, SequenceConflict(f"a concurrent writer holds the key: {exc}")
        except psycopg.DataError as exc:
            return False, InvalidRequest(f"refused by PostgreSQL: {exc}")
    raise AssertionError("unreachable")  # pragma: no cover


class _SlowPath(Exception):
    """A one-statement step failed on the server: the group's transaction is aborted."""


async def apply_group(conn: Conn, ops: Sequence[PgOp]) -> list[tuple[bool, Any]]:
    """Run ``ops`` in ONE transaction; each gets (True, result) or (False, StoreError).
    psycopg errors other than an operation's own propagate (the caller translates).

    Steps with a one-statement form (``onestep.StepOp``) go that way, without a
    savepoint, the statements of consecutive steps of distinct sessions in one
    pipeline (one round trip); if one of them fails on the server (a concurrent
    writer's key, a value refused) the whole group is rolled back and run again with a
    savepoint per operation, so each error is its operation's alone."""
    if any(hasattr(op, "send") for op in ops):
        try:
            return await _apply(conn, ops, fast=True)
        except _SlowPath:
            onestep.COUNTS["groups_rerun"] += 1
    return await _apply(conn, ops, fast=False)


def _run_of(ops: Sequence[PgOp], start: int) -> list[Any]:
    """The one-statement steps from ``start`` on, up to a second step of one session
    or an operation of another kind."""
    run: list[Any] = []
    seen: set[str] = set()
    for op in ops[start:]:
        key = getattr(op, "key", None) if hasattr(op, "send") else None
        if key is None or key in seen:
            break
        seen.add(key)
        run.append(op)
    return run


async def _apply(conn: Conn, ops: Sequence[PgOp], *, fast: bool) -> list[tuple[bool, Any]]:
    results: list[tuple[bool, Any]] = []
    now = time.time()
    async with conn.transaction():
        while len(results) < len(ops):
            run = _run_of(ops, len(results)) if fast else []
            if not run:
                results.append(await _run_op(conn, ops[len(results)]))
                continue
            try:
                async with conn.pipeline():
                    cursors = [await op.send(conn, now) for op in run]
                written = [c is not None and (await c.fetchone() or (0,))[0] == 1
                           for c in cursors]
            except (pgerr.UniqueViolation, psycopg.DataError) as exc:
                raise _SlowPath from exc
            onestep.COUNTS["one_statement"] += sum(written)
            onestep.COUNTS["slow"] += len(run) - sum(written)
            for op, done in zip(run, written, strict=True):
                results.append((True, None) if done else await _run_op(conn, op))
    return results
