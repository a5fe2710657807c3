"""``PgStore``: the session store on PostgreSQL, through psycopg 3 (async).

Same surface and guarantees as the SQLite ``Store`` (``supervisor.store.port``): one
writer connection that group-commits (``GroupCommitter``: concurrent sessions' steps in
one transaction, so one WAL flush), up to ``READERS`` reader connections (the first opened
at start, the others at the first read that finds every open one busy: a takeover loads
many sessions at once).

Invariants:
- Commit before visible: a ``commit`` returns after the COMMIT of its group returned.
  A group whose COMMIT was cut by a lost connection fails its callers with
  ``StoreUnavailable``; whether it committed is unknown, and a retry is safe because
  writes are idempotent by key.
- A broken connection is replaced at the next use (bounded by ``connect_timeout_s``);
  until PostgreSQL is back, writes and reads fail with ``StoreUnavailable`` (retryable)
  and the process stays up.
- Serialization failures and deadlocks (``StoreBusy``) are retried with capped backoff
  up to ``busy_deadline_s`` (the same policy as SQLite's busy retry).
- Lease mode after an outage: a lease that lapsed while PostgreSQL was unreachable is
  taken back (``renew``, ``reacquire``) only if nobody acquired it meanwhile (its row
  still holds this owner and the epoch held); otherwise it is lost and given up.
  ``claim`` never takes a session this store still holds (renew decides those).
- Messages and logs name the URL without its password (``url.redact``).
- The schema is exactly ``pg.schema.SCHEMA_VERSION`` (created in an empty database,
  otherwise ``SchemaMismatch`` with the command that migrates it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import socket
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import psycopg
from psycopg import pq

from supervisor.store import port
from supervisor.store.codec import Limits, check_key, encode
from supervisor.store.errors import (
    InvalidRequest,
    LeaseLost,
    StoreClosed,
    StoreError,
    StoreUnavailable,
)
from supervisor.store.group import GroupCommitter, GroupCounts
from supervisor.store.pg import leases, reader, schema, writer
from supervisor.store.pg.errors import translate
from supervisor.store.pg.onestep import StepOp
from supervisor.store.pg.schema import Conn
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
from supervisor.store.store import DEFAULT_BUSY_DEADLINE_S, _retry_busy
from supervisor.store.url import check_url, redact, scrub
from supervisor.store.writer import prepare_step

log = logging.getLogger(__name__)
R = TypeVar("R")
# A delete waits this long, at most, for the lease of a session terminated elsewhere
# (released as it closes; otherwise it lapses within the lease).
DELETE_WAIT_S = 10.0

DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_LEASE_S = 10.0
READERS = 4  # reader connections at most (concurrent loads of a takeover's resume)
MIGRATE_COMMAND = "corral store migrate"


async def connect(url: str, *, timeout_s: float, what: str,
                  idle_in_transaction_s: float | None = None) -> Conn:
    """One autocommit connection; any failure is ``StoreUnavailable`` naming the redacted
    URL (never the password: libpq's own message can quote the conninfo).

    ``idle_in_transaction_s``: the server ends this connection's session when it sits
    that long inside a transaction (a supervisor paused mid-group would otherwise hold
    its lease rows' locks, and block the takeover, for as long as it is paused)."""
    shown = redact(url)
    options = ""
    if idle_in_transaction_s is not None:
        ms = max(1, int(idle_in_transaction_s * 1000))
        options = f"-c idle_in_transaction_session_timeout={ms}"
    try:
        async with asyncio.timeout(timeout_s):
            conn = await psycopg.AsyncConnection.connect(
                url, autocommit=True, connect_timeout=max(2, int(timeout_s)),
                application_name="corral-supervisor", options=options)
    except TimeoutError:
        raise StoreUnavailable(f"{what}: PostgreSQL at {shown} did not answer within "
                               f"{timeout_s:.0f}s") from None
    except psycopg.Error as exc:
        error = translate(exc, what, shown)
        if isinstance(error, StoreUnavailable):
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else "no reason"
            error = StoreUnavailable(f"{what}: cannot connect to PostgreSQL at {shown}: "
                                     f"{scrub(first, url)}")
        else:  # libpq's own complaints about the conninfo quote its values
            error = type(error)(scrub(error.message, url))
        raise error from None
    return conn


def _gone_while_idle(conn: Conn) -> bool:
    """Whether the server ended this idle connection (a restart, an admin shutdown: its
    FATAL notice or EOF is waiting on the socket). psycopg learns it only at the next
    statement, which then failed: after PostgreSQL came back, each connection's first
    use (the first write, the first read) failed once with ``StoreUnavailable``. Called
    under the link's lock, when no statement is outstanding."""
    try:
        for _ in range(8):  # the FATAL notice, then the end (EOF)
            readable, _, _ = select.select([conn.pgconn.socket], [], [], 0)
            if not readable:
                break
            conn.pgconn.consume_input()  # raises at the end of the stream
    except (psycopg.Error, OSError, ValueError):
        return True
    return conn.pgconn.status != pq.ConnStatus.OK


class _Link:
    """One connection that is replaced when it breaks (never two at once)."""

    def __init__(self, url: str, conn: Conn | None, timeout_s: float, name: str,
                 idle_in_transaction_s: float | None = None) -> None:
        self.url = url
        self.conn: Conn | None = conn
        self._timeout_s = timeout_s
        self._name = name
        self._idle_s = idle_in_transaction_s
        self.lock = asyncio.Lock()

    async def get(self) -> Conn:
        if self.conn is None or self.conn.closed or self.conn.broken \
                or _gone_while_idle(self.conn):
            if self.conn is not None:
                await self.conn.close()
                self.conn = None
            self.conn = await connect(self.url, timeout_s=self._timeout_s,
                                      what=f"reconnecting the store's {self._name}",
                                      idle_in_transaction_s=self._idle_s)
            log.info("store %s reconnected to %s", self._name, redact(self.url))
        return self.conn

    async def close(self) -> None:
        if self.conn is not None:
            await self.conn.close()
            self.conn = None


class PgStore(GroupCounts):
    """The durable session store on PostgreSQL. Create with ``await PgStore.open(url)``."""

    def __init__(self, url: str, writer_link: _Link, reader_link: _Link, *, limits: Limits,
                 busy_deadline_s: float, max_group_ops: int, max_pending_ops: int,
                 owner: str | None = None, lease_s: float = DEFAULT_LEASE_S) -> None:
        self.url = url
        self.limits = limits
        # Lease mode (several supervisors): every write for a session is fenced by the
        # epoch this store holds for it (pg/leases.py); None: one supervisor, no leases.
        self.owner = owner
        self.lease_s = lease_s
        self._held: dict[str, tuple[int, int]] = {}  # session_id -> (sid, epoch)
        self._lease_lock = asyncio.Lock()  # renew / reacquire / claim change _held in turn
        self._shown = redact(url)
        self._writer = writer_link
        self._readers = [reader_link] + [  # connected at their first use
            _Link(url, None, reader_link._timeout_s, f"reader {n}")
            for n in range(2, READERS + 1)]
        self._turn = 0
        # Claims, renewals and heartbeats: single statements on a connection of their
        # own, so they never wait behind the writer's backlog of steps (an overloaded
        # supervisor would otherwise let its leases lapse with its queue full).
        self._leaser = _Link(url, None, reader_link._timeout_s, "lease keeper")
        self._busy_deadline_s = busy_deadline_s
        self._group: GroupCommitter[writer.PgOp] = GroupCommitter(
            self._apply, max_group_ops=max_group_ops, max_pending_ops=max_pending_ops,
            name=f"store-writer:{self._shown}")
        self._closed = False
        self.busy_retries = 0

    @classmethod
    async def open(cls, url: str, *, limits: Limits | None = None,
                   busy_deadline_s: float = DEFAULT_BUSY_DEADLINE_S,
                   connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                   max_group_ops: int = 256, max_pending_ops: int = 65_536,
                   migrate_command: str = MIGRATE_COMMAND, owner: str | None = None,
                   lease_s: float = DEFAULT_LEASE_S) -> PgStore:
        """Connect, check (or create) the schema, start the writer task.

        With ``owner`` (this supervisor's id) the store is in lease mode: it writes only
        for sessions whose lease it holds, each write fenced by the lease's epoch.
        Raises ``StoreUnavailable`` (unreachable, naming the URL without its password),
        ``SchemaMismatch`` (another schema version: run ``migrate_command``)."""
        check_url(url)
        if owner is not None and not 0.2 <= lease_s <= 3600:
            raise InvalidRequest(f"lease_s must be in [0.2, 3600] seconds, not {lease_s}")
        shown = redact(url)
        idle_s = lease_s / 2 if owner is not None else None
        writer_conn = await connect(url, timeout_s=connect_timeout_s, what="opening the store",
                                    idle_in_transaction_s=idle_s)
        try:
            try:
                await schema.ensure(writer_conn, where=shown, command=migrate_command)
            except psycopg.Error as exc:
                raise translate(exc, f"checking the store schema at {shown}", shown) from exc
            reader_conn = await connect(url, timeout_s=connect_timeout_s,
                                        what="opening the store's reader")
        except BaseException:
            await writer_conn.close()
            raise
        store = cls(url, _Link(url, writer_conn, connect_timeout_s, "writer", idle_s),
                    _Link(url, reader_conn, connect_timeout_s, "reader"),
                    limits=limits or Limits(), busy_deadline_s=busy_deadline_s,
                    max_group_ops=max_group_ops, max_pending_ops=max_pending_ops,
                    owner=owner, lease_s=lease_s)
        store._group.start()
        return store

    @property
    def where(self) -> str:
        return self._shown

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
                for link in (*self._readers, self._leaser):
                    await link.close()

    async def __aenter__(self) -> PgStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ running SQL

    async def _on(self, link: _Link, fn: Callable[[Conn], Awaitable[R]], what: str) -> R:
        """Run ``fn`` on ``link``'s connection; translate errors; retry busy ones."""
        async def attempt() -> R:
            async with link.lock:
                conn = await link.get()
                try:
                    return await fn(conn)
                except psycopg.Error as exc:
                    raise translate(exc, what, self._shown) from exc
        return await _retry_busy(attempt, self._busy_deadline_s, what, self._count_retry)

    def _count_retry(self) -> None:
        self.busy_retries += 1

    async def _apply(self, ops: Sequence[writer.PgOp]) -> list[tuple[bool, Any]]:
        return await self._on(self._writer, partial(writer.apply_group, ops=ops),
                              "committing")

    async def _read(self, fn: Callable[[Conn], Awaitable[R]], what: str) -> R:
        if self._group.closing:
            raise StoreClosed("the store is closed")
        return await self._on(self._reader_link(), fn, what)

    def _reader_link(self) -> _Link:
        """A reader that is free, preferring one already connected; if all are busy, the
        next in turn (each lock queues its waiters in order)."""
        free = [link for link in self._readers if not link.lock.locked()]
        if free:
            return min(free, key=lambda link: link.conn is None)
        self._turn = (self._turn + 1) % len(self._readers)
        return self._readers[self._turn]

    # ------------------------------------------------------------------ writes

    async def create_session(self, record: SessionRecord, first: StepWrite | None = None) -> None:
        if first is not None and first.session_id != record.session_id:
            raise InvalidRequest("first step belongs to another session")
        check_key(record.session_id, "session id")
        check_key(record.parent_session_id, "parent session id")
        config = encode(record.config, what="session config",
                        limit=self.limits.max_config_bytes)
        prepared = prepare_step(first, self.limits) if first is not None else None
        held = await self._group.submit(partial(_create, record, config, prepared,
                                                self.owner, self.lease_s))
        self._hold(record.session_id, held)

    def _fence(self, session_id: str) -> tuple[str, int] | None:
        """The token a write for ``session_id`` carries, taken NOW (at the call), so a
        lease lost and re-taken before the group runs still refuses this write."""
        if self.owner is None:
            return None
        held = self._held.get(session_id)
        if held is None:
            raise LeaseLost(f"session {session_id!r}: this supervisor ({self.owner}) holds "
                            "no lease on it; the write was refused")
        return self.owner, held[1]

    def _hold(self, session_id: str, held: tuple[int, int] | None) -> None:
        if held is not None:
            self._held[session_id] = held

    async def commit(self, step: StepWrite) -> None:
        """Commit one step in one transaction (shared with concurrent sessions' steps)."""
        prepared = prepare_step(step, self.limits)
        await self._group.submit(StepOp(prepared, self._fence(step.session_id)))

    async def commit_many(self, steps: list[StepWrite]) -> None:
        prepared = [prepare_step(s, self.limits) for s in steps]
        futures = [self._group.enqueue(StepOp(p, self._fence(p.session_id)))
                   for p in prepared]
        results = await asyncio.gather(*futures, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def set_status(self, session_id: SessionId, status: str) -> None:
        await self._group.submit(partial(_status, session_id, status,
                                         self._fence(session_id)))

    async def delete_session(self, session_id: SessionId) -> None:
        if self.owner is not None and session_id not in self._held:
            # A terminated session left its owner's memory and its lease was released:
            # any supervisor takes the lease for the delete (a new epoch fences whoever
            # held it); an active one, or one another supervisor holds, is refused.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + min(self.lease_s + 0.5, DELETE_WAIT_S)
            while True:
                try:
                    await self._group.submit(partial(_delete_closed, session_id,
                                                     self.owner, self.lease_s))
                    return
                except LeaseLost:  # its owner releases it as it closes, or it lapses
                    if loop.time() >= deadline:
                        raise
                await asyncio.sleep(0.05)
        await self._group.submit(partial(_delete, session_id, self._fence(session_id)))
        self._held.pop(session_id, None)

    async def fork(self, session_id: SessionId, *, at_sequence: int,
                   new_session_id: SessionId) -> SessionRecord:
        check_key(new_session_id, "new session id")
        record, held = await self._group.submit(
            partial(_fork, session_id, at_sequence, new_session_id, self.limits,
                    self.owner, self.lease_s))
        self._hold(new_session_id, held)
        result: SessionRecord = record
        return result

    # ------------------------------------------------------------------ leases

    def held(self) -> dict[SessionId, int]:
        """The sessions this store holds a lease on, with their epochs."""
        return {SessionId(k): v[1] for k, v in self._held.items()}

    def epoch_of(self, session_id: SessionId) -> int | None:
        """The epoch this store's next write for ``session_id`` carries (None: none held)."""
        held = self._held.get(session_id)
        return held[1] if held is not None else None

    def _require_owner(self) -> str:
        if self.owner is None:
            raise InvalidRequest("this store was opened without an owner (no lease mode)")
        return self.owner

    async def acquire(self, session_id: SessionId) -> int | None:
        """Take the session's lease if it is free or expired: its new epoch, or None."""
        owner = self._require_owner()
        held = await self._group.submit(partial(_acquire, session_id, owner, self.lease_s))
        self._hold(session_id, held)
        return held[1] if held is not None else None

    async def claim(self, limit: int, *, own: bool = False) -> list[SessionId]:
        """Acquire up to ``limit`` active sessions nobody holds a live lease on; with
        ``own``, also those still leased to this owner id (at start-up: a restarted
        supervisor takes its sessions back without waiting for the leases to lapse)."""
        owner = self._require_owner()
        async with self._lease_lock:
            # Never a session still held here (in memory): renew decides those, taking a
            # lapsed one back only if nobody owned it meanwhile.
            exclude = sorted(n for n, _ in self._held.values())
            got: list[tuple[str, tuple[int, int]]] = await self._lease_op(
                partial(_claim, owner, self.lease_s, limit, own, exclude), "claiming sessions")
            for session_id, held in got:
                self._hold(session_id, held)
        return [SessionId(sid) for sid, _ in got]

    async def renew(self) -> list[SessionId]:
        """Extend every lease still held. A lease that lapsed (this process was paused or
        cut off from PostgreSQL) is taken back under a new epoch if nobody acquired it
        meanwhile (``leases.reacquire``). Forget and return the sessions lost (taken by
        another, or released: the caller gives them up without publishing anything)."""
        owner = self._require_owner()
        async with self._lease_lock:
            # Only leases held before the statement started count: one taken meanwhile (a
            # create or an acquire committing on the writer) is not in what it saw.
            before = dict(self._held)
            live: dict[int, int] = await self._lease_op(
                partial(_renew, owner, self.lease_s, {n: e for n, e in before.values()}),
                "renewing the leases")
            lost = []
            for sid, (n, epoch) in before.items():
                if self._held.get(sid) != (n, epoch):
                    continue
                if n not in live:
                    lost.append(sid)
                    del self._held[sid]
                elif live[n] != epoch:
                    log.info("session %s: lease lapsed and taken back (epoch %d -> %d)",
                             sid, epoch, live[n])
                    self._held[sid] = (n, live[n])
        return [SessionId(s) for s in lost]

    async def reacquire(self, session_id: SessionId, epoch: int) -> int | None:
        """After a write under ``epoch`` was refused (``LeaseLost``): the epoch to write
        under now, or None (lost: another supervisor acquired the session since, or it
        was released; give it up). A lease taken back meanwhile (by ``renew``) is
        answered from memory; a lapsed one is taken back only if its row still holds
        this owner and ``epoch`` (``leases.reacquire``)."""
        owner = self._require_owner()
        async with self._lease_lock:
            held = self._held.get(session_id)
            if held is None:
                return None
            if held[1] != epoch:
                return held[1]
            got: dict[int, int] = await self._lease_op(
                partial(_reacquire, owner, self.lease_s, {held[0]: epoch}),
                "taking a lapsed lease back")
            if held[0] not in got:
                del self._held[session_id]
                return None
            self._held[session_id] = (held[0], got[held[0]])
            return got[held[0]]

    async def release(self, session_id: SessionId) -> None:
        owner = self._require_owner()
        held = self._held.pop(session_id, None)
        if held is not None:
            await self._group.submit(partial(_release, held, owner))

    async def sign_off(self) -> int:
        """Stopping cleanly: release every lease held, after the writes queued before
        (``leases.sign_off``); nothing is written for those sessions afterwards (each
        write is fenced by the epoch released). Returns how many were released."""
        owner = self._require_owner()
        async with self._lease_lock:
            held = list(self._held.values())
            self._held.clear()
            released: int = await self._group.submit(
                partial(_sign_off, owner, self.lease_s, held))
        return released

    async def next_lapse(self) -> float | None:
        """Seconds until the soonest live lease of another supervisor lapses, or None."""
        return await self._lease_op(partial(leases.next_lapse, owner=self._require_owner()),
                                    "reading the next lease expiry")

    async def lease_owners(self) -> list[tuple[str, int, float]]:
        """(owner, sessions, seconds left on its soonest-expiring lease) per live owner."""
        return await self._read(leases.owners, "reading the leases")

    async def roster(self, window_s: float) -> list[tuple[Any, ...]]:
        """The supervisors heard within ``window_s`` or holding leases (``leases.roster``)."""
        return await self._read(partial(leases.roster, window_s=window_s),
                                "reading the supervisors")

    async def holder(self) -> tuple[str, int, str, float] | None:
        """(host, pid, address, heartbeat age) of the process last advertised under this
        store's owner id."""
        return await self._read(partial(leases.holder, owner=self._require_owner()),
                                "reading this supervisor id's holder")

    async def advertise(self, address: str) -> None:
        """Record this supervisor's client address, where others redirect its clients."""
        owner = self._require_owner()
        await self._read(partial(leases.advertise, owner=owner, address=address,
                                 host=socket.gethostname(), pid=os.getpid()),
                         "recording this supervisor's address")

    async def beat(self) -> None:
        await self._lease_op(partial(leases.beat, owner=self._require_owner()),
                             "recording this supervisor's heartbeat")

    async def _lease_op(self, fn: Callable[[Conn], Awaitable[R]], what: str) -> R:
        """One lease statement (autocommit) on the lease keeper's connection."""
        if self._group.closing:
            raise StoreClosed("the store is closed")
        return await self._on(self._leaser, fn, what)

    async def loads(self) -> list[tuple[str, str, int]]:
        """(supervisor id, address, sessions owned) of the live supervisors, least first."""
        return await self._read(partial(leases.loads, lease_s=self.lease_s),
                                "reading the supervisors' loads")

    async def locate(self, session_id: SessionId) -> tuple[str, str, str | None] | None:
        """(owner, address, tenant) of a session leased live to *another* supervisor."""
        found = await self._read(partial(leases.locate, session_id=session_id),
                                 "locating a session's owner")
        return None if found is None or found[0] == self.owner else found

    # ------------------------------------------------------------------ reads

    async def load(self, session_id: SessionId) -> LoadedSession | None:
        return await self._read(partial(_load, session_id), "loading a session")

    async def context_at(self, session_id: SessionId, *, at_batch: int,
                         epoch: int | None = None) -> list[dict[str, Any]] | None:
        return await self._read(partial(_context_of, session_id, at_batch, epoch),
                                "reading a context")

    async def get_session(self, session_id: SessionId) -> SessionRecord | None:
        return await self._read(partial(_get_session, session_id), "reading a session")

    async def active_sessions(self) -> list[SessionId]:
        """The active sessions; in lease mode, those this store holds a lease on (what
        this supervisor resumes)."""
        if self.owner is not None:
            return sorted(self.held())
        return await self._read(reader.active_sessions, "listing active sessions")

    async def list_sessions(self, *, after: str | None = None,
                            limit: int = 100) -> Page[SessionRecord]:
        return await self._read(partial(_list_sessions, after, limit), "listing sessions")

    async def transcript_page(self, session_id: SessionId, *,
                              before_sequence: int | None = None,
                              max_batches: int = 50) -> Page[TranscriptBatch]:
        return await self._read(partial(_transcript_page, session_id, before_sequence,
                                        max_batches), "reading the transcript")

    async def events_page(self, session_id: SessionId, *, after_sequence: int = 0,
                          limit: int = 500) -> Page[EventRecord]:
        return await self._read(partial(_events_page, session_id, after_sequence, limit),
                                "reading events")

    async def executions_page(self, session_id: SessionId, *, before: str | None = None,
                              limit: int = 50) -> Page[ExecutionRecord]:
        return await self._read(partial(_executions_page, session_id, before, limit),
                                "reading executions")

    async def replay_events(self, session_id: SessionId, *,
                            max_events: int = 100_000) -> list[EventRecord]:
        return await port.replay_events(self, session_id, max_events)


# Operations and reads with the connection last (partial() binds the rest).

async def _fenced(conn: Conn, session_id: str, fence: tuple[str, int] | None) -> None:
    if fence is not None:
        sid = await writer.require_sid(conn, session_id)
        await leases.check(conn, sid, session_id, *fence)


async def _take(conn: Conn, session_id: str, owner: str | None,
                lease_s: float) -> tuple[int, int] | None:
    """A new session's lease (lease mode), in the transaction that creates it."""
    if owner is None:
        return None
    sid = await writer.require_sid(conn, session_id)
    epoch = await leases.acquire(conn, sid, owner, lease_s)
    if epoch is None:
        raise LeaseLost(f"session {session_id!r} is leased to another supervisor")
    return sid, epoch


async def _create(record: SessionRecord, config: str, first: Any, owner: str | None,
                  lease_s: float, conn: Conn) -> tuple[int, int] | None:
    await writer.create_session(conn, record, config, first)
    return await _take(conn, record.session_id, owner, lease_s)


async def _status(session_id: str, status: str, fence: tuple[str, int] | None,
                  conn: Conn) -> None:
    await _fenced(conn, session_id, fence)
    await writer.set_status(conn, session_id, status)


async def _delete(session_id: str, fence: tuple[str, int] | None, conn: Conn) -> None:
    await _fenced(conn, session_id, fence)
    await writer.delete_session(conn, session_id)


async def _delete_closed(session_id: str, owner: str, lease_s: float, conn: Conn) -> None:
    """Delete a terminated session this store holds no lease on, under a lease taken in
    the same transaction (free, lapsed, or this owner's)."""
    sid = await writer.require_sid(conn, session_id)
    row = await reader.one(conn, "SELECT status FROM sessions WHERE sid = %s FOR UPDATE",
                           (sid,))
    if row is None or row[0] != "closed":
        raise InvalidRequest(f"session {session_id} is not terminated (it is active, between "
                             "two supervisors); terminate it first: corral terminate "
                             f"{session_id}")
    if await leases.acquire(conn, sid, owner, lease_s) is None:
        raise LeaseLost(f"session {session_id!r} is leased to another supervisor that "
                        "has not released it yet; the delete was refused (try again)")
    await writer.delete_session(conn, session_id)


async def _fork(session_id: str, at_sequence: int, new_session_id: str, limits: Limits,
                owner: str | None, lease_s: float,
                conn: Conn) -> tuple[SessionRecord, tuple[int, int] | None]:
    record = await writer.fork(conn, session_id, at_sequence, new_session_id, limits)
    return record, await _take(conn, new_session_id, owner, lease_s)


async def _acquire(session_id: str, owner: str, lease_s: float,
                   conn: Conn) -> tuple[int, int] | None:
    sid = await writer.require_sid(conn, session_id)
    epoch = await leases.acquire(conn, sid, owner, lease_s)
    return (sid, epoch) if epoch is not None else None


async def _claim(owner: str, lease_s: float, limit: int, own: bool, exclude: list[int],
                 conn: Conn) -> list[tuple[str, tuple[int, int]]]:
    return [(session_id, (sid, epoch)) for sid, session_id, epoch
            in await leases.claim(conn, owner, lease_s, limit, own, exclude)]


async def _renew(owner: str, lease_s: float, held: dict[int, int],
                 conn: Conn) -> dict[int, int]:
    """{sid: epoch now} of the held leases still this store's: renewed under the epoch
    held, or lapsed and taken back under a new one. A lease renewed under another epoch
    (another process of this owner id acquired it) is not among them: lost."""
    live = await leases.renew(conn, owner, lease_s, list(held))
    kept = {n: e for n, e in held.items() if live.get(n) == e}
    lapsed = {n: e for n, e in held.items() if n not in live}
    return {**kept, **await leases.reacquire(conn, owner, lease_s, lapsed)}


async def _reacquire(owner: str, lease_s: float, held: dict[int, int],
                     conn: Conn) -> dict[int, int]:
    return await leases.reacquire(conn, owner, lease_s, held)


async def _sign_off(owner: str, lease_s: float, held: list[tuple[int, int]],
                    conn: Conn) -> int:
    return await leases.sign_off(conn, owner, lease_s, held)


async def _release(held: tuple[int, int], owner: str, conn: Conn) -> None:
    await leases.release(conn, held[0], owner, held[1])


async def _load(session_id: str, conn: Conn) -> LoadedSession | None:
    return await reader.load(conn, session_id)


async def _context_of(session_id: str, at_batch: int, epoch: int | None,
                      conn: Conn) -> list[dict[str, Any]] | None:
    return await reader.context_of(conn, session_id, at_batch, epoch)


async def _get_session(session_id: str, conn: Conn) -> SessionRecord | None:
    return await reader.get_session(conn, session_id)


async def _list_sessions(after: str | None, limit: int, conn: Conn) -> Page[SessionRecord]:
    return await reader.list_sessions(conn, after, limit)


async def _transcript_page(session_id: str, before: int | None, max_batches: int,
                           conn: Conn) -> Page[TranscriptBatch]:
    return await reader.transcript_page(conn, session_id, before, max_batches)


async def _events_page(session_id: str, after: int, limit: int,
                       conn: Conn) -> Page[EventRecord]:
    return await reader.events_page(conn, session_id, after, limit)


async def _executions_page(session_id: str, before: str | None, limit: int,
                           conn: Conn) -> Page[ExecutionRecord]:
    return await reader.executions_page(conn, session_id, before, limit)


__all__ = ["MIGRATE_COMMAND", "PgStore", "StoreError", "connect"]
