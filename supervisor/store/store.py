"""The async ``Store``: one writer connection that group-commits, one reader connection.

Both connections are aiosqlite connections, i.e. one SQLite connection on its own
thread. PERF.md: each await into aiosqlite costs a thread hop (~80 us), so every public
operation here is ONE hop: a whole transaction (or a whole consistent read) is a plain
function run on the connection's thread (``_in_thread``).

Group commit: ``commit`` prepares its step (validation, encoding) on the caller's side,
hands it to the ``GroupCommitter`` (``group.py``, shared with the PostgreSQL store) and
awaits a future. The committer's task takes everything pending (up to
``max_group_ops``), applies it in ONE transaction on the writer thread
(``writer.apply_group``), and only then resolves each awaiter. Concurrent sessions
therefore share one COMMIT (and one fsync under synchronous=FULL).

Invariants:
- Commit before visible: ``commit`` returns only after the transaction holding the
  step committed; the engine publishes the step's events after that.
- A cancelled ``commit`` may still commit (the group is already on the thread); that
  is safe because writes are idempotent by key (see ``writer``).
- SQLITE_BUSY is retried with capped exponential backoff until ``busy_deadline_s``, then
  ``StoreBusy``. SQLITE_FULL rolls the whole group back and raises ``StoreFull``.
- The writer task (the committer's) is owned by the Store: started by ``open``, drained
  and awaited by ``close``. Pending writes are bounded (``max_pending_ops``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import sqlite3
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import aiosqlite

from supervisor.store import port, reader, schema, writer
from supervisor.store.codec import Limits, check_key, encode
from supervisor.store.errors import (
    InvalidRequest,
    StoreBusy,
    StoreClosed,
    translate_sqlite_error,
)
from supervisor.store.group import GroupCommitter, GroupCounts
from supervisor.store.records import (
    EventRecord,
    ExecutionRecord,
    LoadedSession,
    Page,
    SessionId,
    SessionRecord,
    StepWrite,
    TranscriptBatch,
)

log = logging.getLogger(__name__)
R = TypeVar("R")

DEFAULT_BUSY_DEADLINE_S = 5.0
_BACKOFF_FIRST_S = 0.005
_BACKOFF_MAX_S = 0.2


async def _in_thread(
    conn: aiosqlite.Connection, fn: Callable[..., R], *args: Any, what: str
) -> R:
    """Run ``fn(sqlite3_connection, *args)`` on the aiosqlite connection's thread: ONE hop.

    aiosqlite has no public "run this function on your thread" call; ``_execute`` is the
    one it uses for every method (stable since 0.17). This is the only place we use it.
    sqlite3 errors are translated here, on the thread, at the one boundary.
    """

    def call() -> R:
        try:
            return fn(conn._conn, *args)
        except sqlite3.Error as exc:
            raise translate_sqlite_error(exc, what) from exc

    result: R = await conn._execute(call)  # type: ignore[no-untyped-call]
    return result


async def _connect(path: Path, synchronous: str) -> aiosqlite.Connection:
    """An aiosqlite connection (its own thread) with the store's settings.

    The connector only opens the file; everything that can fail on a bad file runs
    afterwards, so a failure closes the connection through ``close()`` and leaves no
    thread behind that would later call into a closed event loop.
    """
    conn = aiosqlite.Connection(partial(schema.open_raw, path), iter_chunk_size=64)
    try:
        await conn
    except BaseException:
        # aiosqlite stopped its thread itself; wait for it so that it does not resolve
        # its stop future after this event loop is gone.
        thread = getattr(conn, "_thread", None)
        if thread is not None:
            await asyncio.to_thread(thread.join, 5.0)
        raise
    try:
        await _in_thread(conn, schema.configure, synchronous, what="configuring")
    except BaseException:
        await conn.close()
        raise
    return conn


async def _retry_busy(
    attempt: Callable[[], Awaitable[R]], deadline_s: float, what: str,
    on_retry: Callable[[], None] | None = None,
) -> R:
    """Retry ``attempt`` on StoreBusy with capped, jittered exponential backoff."""
    deadline = time.monotonic() + deadline_s
    delay_s = _BACKOFF_FIRST_S
    tries = 0
    while True:
        tries += 1
        try:
            return await attempt()
        except StoreBusy as exc:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise StoreBusy(
                    f"{what}: database still locked after {deadline_s:.1f}s ({tries} tries)"
                ) from exc
            if on_retry is not None:
                on_retry()
            await asyncio.sleep(min(left_s, delay_s * (0.5 + random.random())))
            delay_s = min(delay_s * 2, _BACKOFF_MAX_S)


class Store(GroupCounts):
    """The durable session store. Create with ``await Store.open(path)``."""

    def __init__(
        self,
        path: Path,
        writer_conn: aiosqlite.Connection,
        reader_conn: aiosqlite.Connection,
        *,
        limits: Limits,
        busy_deadline_s: float,
        max_group_ops: int,
        max_pending_ops: int,
    ) -> None:
        self.path = path
        self.limits = limits
        self._writer = writer_conn
        self._reader = reader_conn
        self._busy_deadline_s = busy_deadline_s
        self._sids = writer.Sids()
        self._group: GroupCommitter[writer.WriteOp] = GroupCommitter(
            self._apply, max_group_ops=max_group_ops, max_pending_ops=max_pending_ops,
            name=f"store-writer:{path.name}")
        self._closed = False
        # Counter for tests and benchmarks (the group counters are the committer's).
        self.busy_retries = 0

    @classmethod
    async def open(
        cls,
        path: Path,
        *,
        synchronous: str = schema.DEFAULT_SYNCHRONOUS,
        busy_deadline_s: float = DEFAULT_BUSY_DEADLINE_S,
        limits: Limits | None = None,
        max_group_ops: int = 256,
        max_pending_ops: int = 65_536,
        max_db_pages: int | None = None,
    ) -> Store:
        """Open (creating and migrating if needed) the store at ``path``.

        ``synchronous``: NORMAL (default) or FULL; see docs/storage.md.
        ``max_db_pages``: an optional size quota (SQLite ``max_page_count`` on the writer
        connection); a commit that would grow the file past it fails with ``StoreFull``
        exactly like a full disk.
        Raises ``SchemaTooNew`` for a database written by a newer Corral.
        """
        path = Path(path)
        schema.check_synchronous(synchronous)
        writer_conn = await _connect(path, synchronous)
        try:
            await _retry_busy(
                lambda: _in_thread(writer_conn, schema.migrate, what="migrating"),
                busy_deadline_s,
                "migrating",
            )
            await _in_thread(writer_conn, _writer_pragmas, max_db_pages, what="configuring")
            reader_conn = await _connect(path, synchronous)
        except BaseException:
            await writer_conn.close()
            raise
        store = cls(
            path, writer_conn, reader_conn,
            limits=limits or Limits(), busy_deadline_s=busy_deadline_s,
            max_group_ops=max_group_ops, max_pending_ops=max_pending_ops,
        )
        store._group.start()
        return store

    async def close(self) -> None:
        """Commit what is pending, stop the writer task, close both connections."""
        if self._closed:
            return
        try:
            await self._group.close()
        finally:
            self._closed = True
            try:
                await self._writer.close()
            finally:
                await self._reader.close()

    @property
    def where(self) -> str:
        return str(self.path)

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ writes

    async def create_session(self, record: SessionRecord, first: StepWrite | None = None) -> None:
        if first is not None and first.session_id != record.session_id:
            raise InvalidRequest("first step belongs to another session")
        check_key(record.session_id, "session id")
        check_key(record.parent_session_id, "parent session id")
        config = encode(record.config, what="session config",
                        limit=self.limits.max_config_bytes)
        prepared = writer.prepare_step(first, self.limits) if first is not None else None
        await self._submit(partial(_create_op, record, config, prepared))

    async def commit(self, step: StepWrite) -> None:
        """Commit one step in one transaction (shared with concurrent sessions' steps)."""
        prepared = writer.prepare_step(step, self.limits)
        await self._submit(partial(_step_op, prepared))

    async def commit_many(self, steps: list[StepWrite]) -> None:
        """Queue several steps together (normally one group, so one transaction); each
        commits or fails on its own (savepoints). Raises the first failure, if any."""
        prepared = [writer.prepare_step(s, self.limits) for s in steps]
        futures = [self._enqueue(partial(_step_op, p)) for p in prepared]
        results = await asyncio.gather(*futures, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def set_status(self, session_id: SessionId, status: str) -> None:
        await self._submit(partial(_status_op, session_id, status))

    async def delete_session(self, session_id: SessionId) -> None:
        """Remove the session and all its rows (raises ``SessionNotFound``)."""
        await self._submit(partial(_delete_op, session_id))

    async def fork(
        self, session_id: SessionId, *, at_sequence: int, new_session_id: SessionId
    ) -> SessionRecord:
        check_key(new_session_id, "new session id")
        result: SessionRecord = await self._submit(
            partial(_fork_op, session_id, at_sequence, new_session_id, self.limits)
        )
        return result

    def _enqueue(self, op: writer.WriteOp) -> asyncio.Future[Any]:
        return self._group.enqueue(op)

    async def _submit(self, op: writer.WriteOp) -> Any:
        return await self._group.submit(op)

    async def _apply(self, ops: Sequence[writer.WriteOp]) -> list[tuple[bool, Any]]:
        """One group in one transaction on the writer thread, SQLITE_BUSY retried."""
        return await _retry_busy(
            lambda: _in_thread(self._writer, writer.apply_group, self._sids, ops,
                               what="committing"),
            self._busy_deadline_s,
            "committing",
            self._count_busy_retry,
        )

    def _count_busy_retry(self) -> None:
        self.busy_retries += 1

    # ------------------------------------------------------------------ reads

    async def _read(self, fn: Callable[..., R], *args: Any, what: str) -> R:
        if self._group.closing:
            raise StoreClosed("the store is closed")
        return await _retry_busy(
            lambda: _in_thread(self._reader, fn, *args, what=what), self._busy_deadline_s, what,
            self._count_busy_retry,
        )

    async def load(self, session_id: SessionId) -> LoadedSession | None:
        return await self._read(reader.load, session_id, what="loading a session")

    async def context_at(
        self, session_id: SessionId, *, at_batch: int, epoch: int | None = None
    ) -> list[dict[str, Any]] | None:
        """The context right after batch ``at_batch`` was appended: under the newest rewrite
        taken before it, or in ``epoch`` if given. None: no such session."""
        return await self._read(reader.context_of, session_id, at_batch, epoch,
                                what="reading a context")

    async def get_session(self, session_id: SessionId) -> SessionRecord | None:
        return await self._read(reader.get_session, session_id, what="reading a session")

    async def active_sessions(self) -> list[SessionId]:
        return await self._read(reader.active_sessions, what="listing active sessions")

    async def list_sessions(
        self, *, after: str | None = None, limit: int = 100
    ) -> Page[SessionRecord]:
        return await self._read(reader.list_sessions, after, limit, what="listing sessions")

    async def transcript_page(
        self, session_id: SessionId, *, before_sequence: int | None = None,
        max_batches: int = 50,
    ) -> Page[TranscriptBatch]:
        return await self._read(reader.transcript_page, session_id, before_sequence,
                                max_batches, what="reading the transcript")

    async def events_page(
        self, session_id: SessionId, *, after_sequence: int = 0, limit: int = 500
    ) -> Page[EventRecord]:
        return await self._read(reader.events_page, session_id, after_sequence, limit,
                                what="reading events")

    async def executions_page(
        self, session_id: SessionId, *, before: str | None = None, limit: int = 50
    ) -> Page[ExecutionRecord]:
        return await self._read(reader.executions_page, session_id, before, limit,
                                what="reading executions")

    async def replay_events(
        self, session_id: SessionId, *, max_events: int = 100_000
    ) -> list[EventRecord]:
        """The session's whole event journal in order: what a client that saw everything
        has seen (including context_compacted markers). Read page by page; above
        ``max_events`` raises ``RecordTooLarge`` (use ``events_page``)."""
        return await port.replay_events(self, session_id, max_events)


def _writer_pragmas(conn: sqlite3.Connection, max_db_pages: int | None) -> None:
    # Zero the bytes of deleted or overwritten records in pages already being written,
    # so an old state row does not linger in the file (no extra I/O in FAST mode).
    conn.execute("PRAGMA secure_delete = FAST")
    if max_db_pages is not None:
        if not isinstance(max_db_pages, int) or max_db_pages < 1:
            raise InvalidRequest("max_db_pages must be a positive integer")
        conn.execute(f"PRAGMA max_page_count = {max_db_pages}")


def _create_op(record: SessionRecord, config: str, first: writer.PreparedStep | None,
               conn: sqlite3.Connection, sids: writer.Sids) -> None:
    writer.create_session(conn, sids, record, config, first)


def _step_op(prepared: writer.PreparedStep, conn: sqlite3.Connection,
             sids: writer.Sids) -> None:
    writer.apply_step(conn, sids, prepared)


def _status_op(session_id: str, status: str, conn: sqlite3.Connection,
               sids: writer.Sids) -> None:
    writer.set_status(conn, sids, session_id, status)


def _delete_op(session_id: str, conn: sqlite3.Connection, sids: writer.Sids) -> None:
    writer.delete_session(conn, sids, session_id)


def _fork_op(session_id: str, at_sequence: int, new_session_id: str, limits: Limits,
             conn: sqlite3.Connection, sids: writer.Sids) -> SessionRecord:
    return writer.fork(conn, sids, session_id, at_sequence, new_session_id, limits)
