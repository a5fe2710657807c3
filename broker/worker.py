"""The public asyncio worker API of the broker, used by sandbox_worker.

``BrokerWorker.run`` registers the worker's services (READY) and serves
REQUESTs, each in its own task in the session's ``TaskGroup``. Messages are
decoded and dispatched by the socket's listener, straight from the loop's fd
reader callback (``AsyncDealer.listen``), so a REQUEST's task is created in
the iteration in which it became readable; the session's reader task only
supervises the listener (a receive error or a dispatch bug ends it, and so the
session's ``TaskGroup``). Heartbeats and broker-liveness checks run in their
own task, never inside request handling.

Sessions: one DEALER socket and one registration. A session ends (and a new
one starts, with jittered backoff, forever) when the broker is silent for the
liveness window. Within a session the worker re-registers (re-sends READY) on
DISCONNECT from the broker or when the broker's id changes (a restarted
broker). Starting a new session or re-registering *abandons* the work held
for the old registration: those tasks are cancelled and send nothing, since
the broker they belonged to has already failed them as worker_lost.

Several brokers: a worker serving several brokers runs one ``BrokerWorker``
(one link) per broker, all sharing one ``SlotPool`` (``broker/slots.py``):
each link has its own session, liveness and jobs, so a broker's loss abandons
only that link's work; every handler runs inside the pool's slot, and the
pool tells each broker its share (HEARTBEAT capacity). Without a pool (one
broker) nothing of this runs and the wire is as before.

Invariants:
- Every request the worker accepted is answered exactly once for its
  registration (REPLY, HandlerError → FAILURE(kind), unexpected exception →
  FAILURE(internal, retryable=false, one-line message; traceback only in the
  local log), CANCEL → FAILURE(cancelled), past budget → FAILURE(timeout),
  stop() past its drain → FAILURE(worker_lost)), unless it was abandoned.
  A done-callback on each request task answers for a task that was
  cancelled before its first step (its handler body never ran).
  An answer the socket cannot take at once is retried from the heartbeat
  task, so a slot at the broker is never leaked by a full pipe.
- Every answer fits the protocol's field bounds (kinds and messages are
  clipped), so the broker never drops one as malformed.
- ``CancelledError`` is never swallowed: a cancelled request task sends its
  FAILURE and re-raises.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, TypeAlias

from broker import protocol
from broker.errors import BrokerUnavailable, HandlerError
from broker.protocol import FailureKind
from broker.security import CurveClient
from broker.slots import SlotPool
from broker.transport import AsyncDealer

log = logging.getLogger(__name__)

DEADLINE_GRACE_S: Final = 1.0  # the broker cancels at the deadline; this is a backstop
MAX_MESSAGE_CHARS: Final = 1000
MAX_BACKOFF_S: Final = 2.0
STOP_WAIT_S: Final = 5.0

Handler: TypeAlias = Callable[["RequestContext"], Awaitable[bytes]]


class RequestContext:
    """What a handler knows about its request, and how it streams partial output."""

    __slots__ = ("_job", "attempt", "body", "deadline", "request_id", "service")

    def __init__(self, job: _Job, request_id: str, service: str, attempt: int, body: bytes,
                 deadline: float) -> None:
        self._job = job
        self.request_id = request_id
        self.service = service
        self.attempt = attempt
        self.body = body
        self.deadline = deadline  # time.monotonic() deadline from the request's budget_s

    def budget_s(self) -> float:
        """What is left of the request's budget, in seconds (0 once past ``deadline``)."""
        return max(0.0, self.deadline - time.monotonic())

    async def send_partial(self, body: bytes) -> None:
        """Stream one chunk to the caller, in order. Await each call before the next."""
        await self._job.worker._send_partial(self._job, body)


class _Job:
    __slots__ = ("abandoned", "answered", "cancel_kind", "ctx", "next_seq", "task", "worker")

    def __init__(self, worker: BrokerWorker, msg: protocol.Request) -> None:
        self.worker = worker
        self.ctx = RequestContext(self, msg.request_id, msg.service, msg.attempt, msg.body,
                                  time.monotonic() + msg.budget_s)
        self.task: asyncio.Task[None] | None = None
        self.cancel_kind = FailureKind.CANCELLED
        self.abandoned = False
        self.answered = False
        self.next_seq = 0


def _clip(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    line = text.replace("\n", " ").strip()
    return line if len(line) <= limit else line[: limit - 3] + "..."


class BrokerWorker:
    """Serves ``handlers`` (service name → handler) through the broker at ``endpoint``."""

    def __init__(
        self, endpoint: str, handlers: Mapping[str, Handler], *, capacity: int = 1,
        info: Mapping[str, Any] | None = None, heartbeat_interval_s: float = 0.25,
        liveness: int = 4, max_message_bytes: int = protocol.DEFAULT_MAX_MESSAGE_BYTES,
        identity: bytes | None = None, curve: CurveClient | None = None,
        pool: SlotPool | None = None,
    ) -> None:
        if not handlers:
            raise ValueError("a worker needs at least one handler")
        if not 1 <= capacity <= 4096:
            raise ValueError("capacity must be in [1, 4096]")
        if heartbeat_interval_s <= 0 or liveness < 1:
            raise ValueError("heartbeat_interval_s must be > 0 and liveness >= 1")
        self.endpoint = endpoint
        self.curve = curve
        self.handlers = dict(handlers)
        self.capacity = capacity
        self.info: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(),
                                     **(info or {})}
        self.heartbeat_interval_s = heartbeat_interval_s
        self.liveness = liveness
        self.max_message_bytes = max_message_bytes
        self.identity = identity or f"w-{uuid.uuid4().hex}".encode()
        self.instance_id = uuid.uuid4().hex[:16]
        self.dropped: collections.Counter[str] = collections.Counter()
        self.registrations = 0
        self._jobs: dict[str, _Job] = {}
        self._unsent: collections.deque[list[bytes]] = collections.deque()
        self._sock: AsyncDealer | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._session_end: asyncio.Future[str] | None = None
        self._broker_id: str | None = None
        self._last_heard = 0.0
        self._stopping = False
        self._acknowledged = False
        self._running = False
        self._stopped = asyncio.Event()
        self._stop_requested = asyncio.Event()  # cuts a reconnect backoff short
        self._on_ready: Callable[[], None] | None = None
        # Several brokers (broker.slots): the slots are the pool's, shared with
        # the worker's links to the other brokers; None: this broker has them all.
        self.pool = pool
        if pool is not None:
            pool.add(self)

    @property
    def live(self) -> bool:
        """Registered and acknowledged by a broker that is not known to be gone."""
        return self._sock is not None and self._broker_id is not None and not self._stopping

    @property
    def held(self) -> int:
        """Requests accepted from this broker and not answered yet."""
        return sum(1 for job in self._jobs.values() if not job.answered)

    def send_capacity(self, capacity: int) -> None:
        """Tell the broker this link's slots from now on (HEARTBEAT capacity)."""
        self._send(protocol.encode(protocol.Heartbeat(self.instance_id, capacity)))

    @property
    def broker_id(self) -> str | None:
        return self._broker_id

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    @property
    def phase(self) -> str:
        """``stopped``, ``stopping``, ``backoff`` (between sessions), ``registering``
        (READY sent, not yet acknowledged) or ``ready``."""
        if not self._running:
            return "stopped"
        if self._stopping:
            return "stopping"
        if self._sock is None:
            return "backoff"
        return "ready" if self._acknowledged else "registering"

    # ------------------------------------------------------------------ lifecycle

    async def run(self, *, on_ready: Callable[[], None] | None = None) -> None:
        """Serve until ``stop()`` or cancellation; reconnect forever with jittered backoff.

        ``on_ready`` is called once, when the broker first acknowledges READY.
        """
        if self._running:
            raise RuntimeError("BrokerWorker.run() is already running")
        self._running = True
        self._stopped.clear()
        self._on_ready = on_ready
        failures = 0
        try:
            while not self._stopping:
                reason = await self._session()
                if self._stopping:
                    break
                # Back off harder only while sessions keep failing before the broker
                # ever acknowledged us; a session that worked resets the backoff.
                failures = 0 if self._acknowledged else failures + 1
                delay_s = min(MAX_BACKOFF_S, 0.05 * 2 ** min(failures, 6))
                delay_s *= random.uniform(0.5, 1.5)
                log.warning("worker %s reconnecting in %.2fs: %s", self.identity.decode(),
                            delay_s, reason)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay_s):
                        await self._stop_requested.wait()
        finally:
            self._running = False
            self._stopped.set()

    async def stop(self, *, drain_s: float = 5.0) -> None:
        """Take no new work, let in-flight requests finish for ``drain_s``, fail the rest
        (worker_lost, retryable), say DISCONNECT and end ``run()``."""
        if not self._running or self._stopping:
            return
        self._stopping = True
        self._stop_requested.set()
        tasks = [j.task for j in self._jobs.values() if j.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=drain_s)
        left = [j for j in self._jobs.values() if j.task is not None and not j.task.done()]
        for job in left:
            job.cancel_kind = FailureKind.WORKER_LOST
            if job.task is not None:
                job.task.cancel()
        if left:
            await asyncio.wait([j.task for j in left if j.task is not None], timeout=STOP_WAIT_S)
        self._flush_unsent()
        self._send(protocol.encode(protocol.Disconnect("worker stopping")))
        self._end_session("stopped")
        try:
            async with asyncio.timeout(STOP_WAIT_S):
                await self._stopped.wait()
        except TimeoutError:
            log.warning("worker %s: run() did not end within %.1fs of stop()",
                        self.identity.decode(), STOP_WAIT_S)

    async def _session(self) -> str:
        """One socket, one TaskGroup; returns why it ended."""
        loop = asyncio.get_running_loop()
        sock = AsyncDealer(self.endpoint, identity=self.identity,
                           max_message_bytes=self.max_message_bytes, curve=self.curve)
        self._sock = sock
        self._acknowledged = False
        self._session_end = loop.create_future()
        reason = "ended"
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                self._register("new session")
                reader = tg.create_task(self._reader(sock), name="broker-worker-reader")
                beat = tg.create_task(self._heartbeat(sock), name="broker-worker-heartbeat")
                try:
                    reason = await self._session_end
                finally:
                    reader.cancel()
                    beat.cancel()
                    self._abandon_all()
        finally:
            if not self._stopping or reason != "stopped":
                # Leaving without a goodbye would cost the broker a liveness window.
                self._send(protocol.encode(protocol.Disconnect("worker leaving")))
            self._tg = None
            self._sock = None
            self._session_end = None
            sock.close(linger_s=0.5)
            if self.pool is not None:
                self.pool.changed()  # this link is not live now: its share moves
        return reason

    def _end_session(self, reason: str) -> None:
        end = self._session_end
        if end is not None and not end.done():
            end.set_result(reason)

    def _register(self, why: str) -> None:
        """(Re-)send READY; work held for an earlier registration is abandoned."""
        self._abandon_all()
        self._broker_id = None
        self._last_heard = time.monotonic()
        self.registrations += 1
        pool = self.pool
        # With a pool, READY offers at most one slot (READY cannot say 0) until
        # the broker acknowledges it and the pool gives this link its share.
        capacity = self.capacity if pool is None else max(1, pool.advertised(self))
        ready = protocol.Ready(tuple(self.handlers), capacity, self.info)
        self._send(protocol.encode(ready))
        if pool is not None:
            pool.registered(self, capacity)
        log.info("worker %s registering (%s)", self.identity.decode(), why)

    def _abandon_all(self) -> None:
        for job in self._jobs.values():
            job.abandoned = True
            if job.task is not None:
                job.task.cancel()
        self._jobs.clear()
        self._unsent.clear()
        if self.pool is not None:
            self.pool.changed()

    # ------------------------------------------------------------------ I/O

    def _send(self, frames: list[bytes]) -> bool:
        sock = self._sock
        if sock is None or sock.closed:
            return False
        try:
            return sock.send(frames)
        except BrokerUnavailable:
            return False

    def _flush_unsent(self) -> None:
        while self._unsent and self._send(self._unsent[0]):
            self._unsent.popleft()

    async def _reader(self, sock: AsyncDealer) -> None:
        """Supervise the listener; ends with the error that stopped it. Cancelling
        this task stops dispatch at once (it cancels the awaited future)."""
        await sock.listen(self._on_batch)

    def _on_batch(self, batch: list[list[bytes]]) -> None:
        """Called by the socket's listener (a loop callback) with the messages read."""
        self._last_heard = time.monotonic()
        max_bytes = self.max_message_bytes
        for msg in protocol.decode_batch(batch, max_bytes=max_bytes, dropped=self.dropped):
            self._on_message(msg)

    def _on_message(self, msg: protocol.Message) -> None:
        if isinstance(msg, protocol.Request):
            self._start_job(msg)
        elif isinstance(msg, protocol.Cancel):
            job = self._jobs.get(msg.request_id)
            if job is None or job.task is None:
                # Answer anyway: if the REQUEST never reached us (a dropped frame), the
                # broker still counts a slot for it, and only an answer frees it. If we
                # did answer already, the broker drops this one as unknown.
                self.dropped["cancel_unknown_request"] += 1
                self._send(protocol.encode(protocol.FailureReply(
                    msg.request_id, FailureKind.CANCELLED, "request unknown at the worker",
                    False)))
            else:
                job.cancel_kind = FailureKind.CANCELLED
                job.task.cancel()
        elif isinstance(msg, protocol.Heartbeat):
            if msg.peer_id and msg.peer_id != self._broker_id:
                if self._broker_id is not None:
                    self._register(f"broker restarted ({self._broker_id} -> {msg.peer_id})")
                self._broker_id = msg.peer_id
                self._acknowledged = True
                if self.pool is not None:
                    self.pool.changed()
                if self._on_ready is not None:
                    on_ready, self._on_ready = self._on_ready, None
                    on_ready()
        elif isinstance(msg, protocol.Disconnect):
            self._register(f"broker asked: {msg.reason}")
        else:
            self.dropped["wrong_direction"] += 1

    async def _heartbeat(self, sock: AsyncDealer) -> None:
        beat = protocol.encode(protocol.Heartbeat(self.instance_id))
        window = self.heartbeat_interval_s * self.liveness
        pool = self.pool
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            self._flush_unsent()
            # With a pool every beat repeats this link's slots (a lost update heals).
            sock.send(beat if pool is None or not self.live else protocol.encode(
                protocol.Heartbeat(self.instance_id, pool.advertised(self))))
            self._cancel_overdue()
            silent = time.monotonic() - self._last_heard
            if silent > window and not sock.has_input():
                self._end_session(f"broker silent for {silent:.2f}s")
                return

    # ------------------------------------------------------------------ requests

    def _cancel_overdue(self) -> None:
        """Backstop for the broker's own deadline (it sends CANCEL at the deadline):
        a handler still running ``DEADLINE_GRACE_S`` after it is cancelled as a
        timeout. A sweep from the heartbeat task, not a timer per request."""
        cutoff = time.monotonic() - DEADLINE_GRACE_S
        for job in self._jobs.values():
            task = job.task
            if job.ctx.deadline < cutoff and task is not None and not task.cancelling():
                job.cancel_kind = FailureKind.TIMEOUT
                task.cancel()

    def _start_job(self, msg: protocol.Request) -> None:
        rid = msg.request_id
        if rid in self._jobs:
            self.dropped["duplicate_request"] += 1
            return
        if self._stopping or self._tg is None:
            self._send(protocol.encode(protocol.FailureReply(
                rid, FailureKind.WORKER_LOST, "worker is stopping", True)))
            return
        if len(self._jobs) >= 2 * self.capacity + 16:
            self._send(protocol.encode(protocol.FailureReply(
                rid, FailureKind.OVERLOADED, "worker holds too many requests", True)))
            return
        job = _Job(self, msg)
        self._jobs[rid] = job
        job.task = self._tg.create_task(self._serve(job), name=f"request-{rid}")
        job.task.add_done_callback(lambda _task: self._job_done(job))
        if self.pool is not None:
            self.pool.changed()

    async def _serve(self, job: _Job) -> None:
        rid = job.ctx.request_id
        try:
            answer = await self._call_handler(job)
        except asyncio.CancelledError:
            kind = job.cancel_kind
            if kind == FailureKind.TIMEOUT:
                message = "handler ran past its budget"
            else:
                message = f"request {kind} at the worker"
            retryable = kind in (FailureKind.WORKER_LOST, FailureKind.TIMEOUT)
            self._answer(job, protocol.FailureReply(rid, kind, message, retryable))
            raise
        finally:
            if self._jobs.get(rid) is job:
                del self._jobs[rid]
        self._answer(job, answer)

    async def _call_handler(self, job: _Job) -> protocol.Reply | protocol.FailureReply:
        ctx = job.ctx
        rid = ctx.request_id
        handler = self.handlers.get(ctx.service)
        if handler is None:
            return protocol.FailureReply(rid, FailureKind.BAD_REQUEST,
                                         f"this worker has no service {ctx.service!r}", False)
        try:
            if self.pool is None:
                body = await handler(ctx)
            else:
                async with self.pool.slot():  # never more than the pool's slots run
                    body = await handler(ctx)
        except HandlerError as exc:
            kind = exc.kind if 0 < len(exc.kind) <= 64 else FailureKind.INTERNAL
            return protocol.FailureReply(rid, kind, _clip(exc.message), exc.retryable,
                                         exc.body if len(exc.body) <= self.max_message_bytes
                                         else b"")
        except Exception:  # message boundary: the traceback stays in this log
            # Neither the exception's name nor its text crosses the wire: it may
            # echo input, and it reaches whoever reads the failure (the model).
            log.exception("handler for %s failed on request %s", ctx.service, rid)
            return protocol.FailureReply(rid, FailureKind.INTERNAL,
                                         f"the {_clip(ctx.service)} service failed unexpectedly; "
                                         "the worker's log has the details", False)
        if not isinstance(body, bytes):
            return protocol.FailureReply(
                rid, FailureKind.INTERNAL, "the handler returned something other than bytes",
                False)
        if len(body) > self.max_message_bytes - protocol.MAX_META_BYTES:
            return protocol.FailureReply(rid, FailureKind.INTERNAL,
                                         f"reply of {len(body)} bytes exceeds the message limit",
                                         False)
        return protocol.Reply(rid, body)

    def _job_done(self, job: _Job) -> None:
        """Backstop when a request task ends: a task cancelled before its first
        step (a CANCEL read in the same batch as its REQUEST) never runs
        ``_serve``, so nothing answered it, and the broker would hold its slot
        forever. Answer it here, once."""
        rid = job.ctx.request_id
        if self._jobs.get(rid) is job:
            del self._jobs[rid]
        if not job.answered:
            kind = job.cancel_kind
            retryable = kind in (FailureKind.WORKER_LOST, FailureKind.TIMEOUT)
            self._answer(job, protocol.FailureReply(rid, kind, f"request {kind} at the worker",
                                                    retryable))

    def _answer(self, job: _Job, msg: protocol.Reply | protocol.FailureReply) -> None:
        job.answered = True
        if job.abandoned:
            return
        if self.pool is not None:
            # The slot moves (if it does) before the answer frees it at the broker,
            # so the broker never sees a free slot the pool gave to another broker.
            self.pool.changed()
        frames = protocol.encode(msg)
        if self._unsent or not self._send(frames):
            self._unsent.append(frames)  # bounded by the number of jobs

    async def _send_partial(self, job: _Job, body: bytes) -> None:
        if not isinstance(body, bytes):
            raise TypeError("partial body must be bytes")
        if len(body) > self.max_message_bytes - protocol.MAX_META_BYTES:
            raise ValueError(f"partial of {len(body)} bytes exceeds the message limit")
        if job.abandoned:
            return
        frames = protocol.encode(protocol.Partial(job.ctx.request_id, job.next_seq, body))
        job.next_seq += 1
        sock = self._sock
        if sock is None or sock.closed:
            return
        try:
            sent = await sock.send_waiting(frames, deadline=job.ctx.deadline)
        except BrokerUnavailable:
            return
        if not sent:
            raise HandlerError(FailureKind.TIMEOUT, "could not send a partial before the "
                               "deadline: the broker is not reading", retryable=True)
