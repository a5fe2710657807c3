"""The public asyncio client of the broker, used by the supervisor.

``BrokerClient`` owns one DEALER socket and, in the client's own
``TaskGroup``, a reader task and a heartbeat task (heartbeats out, broker
silence, local deadlines). Messages are decoded and calls resolved by the
socket's listener, straight from the loop's fd reader callback
(``AsyncDealer.listen``): a REPLY wakes its caller in the iteration in which
it became readable, with no task wake-up in between (no task per message
either). The reader task only supervises the listener: a receive error, or a
bug in dispatch, ends it and so the ``TaskGroup``, as a reader loop's
exception did. ``start`` sends a REQUEST at once and returns a ``Call``;
``request`` is ``start`` + ``result``.

Invariants:
- Every call ends exactly once, with a REPLY body or a ``RequestFailed``:
  from the broker/worker, or locally when its deadline (``budget_s`` plus a
  small grace) passes, when the broker restarts (new ``broker_id``) or goes
  silent for the liveness window (``worker_lost``, retryable), when its
  partial buffer overflows (``slow_consumer``), or when the client closes.
  An answer that arrives after that is dropped: never delivered twice.
- A call failed locally while the broker may still hold it is CANCELled at
  the broker (best effort), so no worker keeps working for nobody.
- Per-call PARTIAL buffers are bounded (chunks and bytes).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any, Final

from broker import protocol
from broker.errors import BrokerUnavailable, RequestFailed
from broker.protocol import FailureKind
from broker.security import CurveClient
from broker.transport import AsyncDealer

log = logging.getLogger(__name__)

GRACE_S: Final = 0.5  # local deadline = budget_s + this, behind the broker's own
MAX_PARTIAL_CHUNKS: Final = 4096
SLOW_CONSUMER: Final = "slow_consumer"  # local failure kind: partials were not read
CLIENT_CLOSED: Final = "client_closed"  # local failure kind: the client shut down
MAX_SERVICE_CHARS: Final = 64  # READY accepts service names of 1..64 characters


class Call:
    """One request in flight. Iterate it for PARTIAL bodies; ``result()`` for the answer."""

    __slots__ = (
        "_client", "_deadline", "_discard_partials", "_done", "_failure", "_next_seq",
        "_partial_bytes", "_partials", "_reply", "_waiter", "request_id", "service",
    )

    def __init__(self, client: BrokerClient, request_id: str, service: str,
                 deadline: float) -> None:
        self._client = client
        self.request_id = request_id
        self.service = service
        self._deadline = deadline
        self._done = asyncio.Event()
        self._reply: bytes | None = None
        self._failure: protocol.FailureReply | None = None
        self._partials: collections.deque[bytes] = collections.deque()
        self._partial_bytes = 0
        self._next_seq = 0
        self._waiter: asyncio.Future[None] | None = None
        self._discard_partials = False

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        """The next PARTIAL body; stops once the final answer arrived and all were read."""
        while True:
            if self._partials:
                body = self._partials.popleft()
                self._partial_bytes -= len(body)
                return body
            if self._done.is_set():
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def result(self) -> bytes:
        """The REPLY body; raises ``RequestFailed`` for any failure."""
        await self._done.wait()
        if self._failure is not None:
            raise RequestFailed(self._failure)
        return self._reply if self._reply is not None else b""

    async def cancel(self) -> None:
        """Cancel at the broker/worker; ``result()`` then raises RequestFailed(cancelled)."""
        self._client._cancel(self, FailureKind.CANCELLED, "cancelled by the caller")

    # -- called by the client's reader --------------------------------------

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _partial(self, seq: int, body: bytes, max_bytes: int) -> str | None:
        """Buffer one chunk; returns a failure kind if the call must fail instead."""
        if seq != self._next_seq:
            return FailureKind.PROTOCOL
        self._next_seq += 1
        if self._discard_partials:
            return None
        if (len(self._partials) >= MAX_PARTIAL_CHUNKS
                or self._partial_bytes + len(body) > max_bytes):
            return SLOW_CONSUMER
        self._partials.append(body)
        self._partial_bytes += len(body)
        self._wake()
        return None

    def _finish(self, reply: bytes | None, failure: protocol.FailureReply | None) -> None:
        self._reply = reply
        self._failure = failure
        self._done.set()
        self._wake()


class BrokerClient:
    """Asyncio client: ``async with BrokerClient(ep) as c: body = await c.request(...)``."""

    def __init__(
        self, endpoint: str, *, heartbeat_interval_s: float = 0.25, liveness: int = 4,
        max_message_bytes: int = protocol.DEFAULT_MAX_MESSAGE_BYTES,
        identity: bytes | None = None, curve: CurveClient | None = None,
    ) -> None:
        if heartbeat_interval_s <= 0 or liveness < 1:
            raise ValueError("heartbeat_interval_s must be > 0 and liveness >= 1")
        self.endpoint = endpoint
        self.curve = curve
        self.heartbeat_interval_s = heartbeat_interval_s
        self.liveness = liveness
        self.max_message_bytes = max_message_bytes
        self.identity = identity or f"c-{uuid.uuid4().hex}".encode()
        self.instance_id = uuid.uuid4().hex[:16]
        self.dropped: collections.Counter[str] = collections.Counter()
        self._calls: dict[str, Call] = {}
        self._next_id = 0
        self._sock: AsyncDealer | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._broker_id: str | None = None
        self._last_heard: float | None = None
        self._link_up = False

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> BrokerClient:
        self._sock = AsyncDealer(self.endpoint, identity=self.identity,
                                 max_message_bytes=self.max_message_bytes, curve=self.curve)
        self._sock.send_message(protocol.Heartbeat(self.instance_id))
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        self._tasks = [self._tg.create_task(self._reader(), name="broker-client-reader"),
                       self._tg.create_task(self._heartbeat(), name="broker-client-heartbeat")]
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        sock, tg = self._sock, self._tg
        self._sock = None
        self._tg = None
        try:
            if sock is not None and not sock.closed:
                with contextlib.suppress(BrokerUnavailable):
                    sock.send_message(protocol.Disconnect("client closing"))
            for call in list(self._calls.values()):
                self._end(call, None, protocol.FailureReply(
                    call.request_id, CLIENT_CLOSED, "the client was closed", False))
            for task in self._tasks:
                task.cancel()
            if tg is not None:
                await tg.__aexit__(None, None, None)
        finally:
            self._tasks = []
            if sock is not None:
                sock.close(linger_s=0.5)

    # ------------------------------------------------------------------ public API

    @property
    def broker_id(self) -> str | None:
        return self._broker_id

    @property
    def connected(self) -> bool:
        """Heard from the broker within the liveness window."""
        heard = self._last_heard
        window = self.heartbeat_interval_s * self.liveness
        return heard is not None and time.monotonic() - heard <= window

    def start(self, service: str, body: bytes, *, budget_s: float, attempt: int = 1) -> Call:
        """Send a REQUEST now; the returned ``Call`` yields partials and the answer.

        ``budget_s`` is the request's budget in seconds: it travels with the
        REQUEST and the broker and the worker each hold their own deadline
        (``time.monotonic()`` + what is left of it) from it."""
        if not (isinstance(budget_s, int | float) and math.isfinite(budget_s)
                and budget_s > 0):
            raise ValueError(f"budget_s must be a positive number, got {budget_s!r}")
        # Checked here because the broker drops what it cannot decode, and the
        # caller would only learn of it at the deadline.
        if not 0 < len(service) <= MAX_SERVICE_CHARS:
            raise ValueError(f"service must be 1..{MAX_SERVICE_CHARS} characters")
        if not 1 <= attempt <= 1_000_000:
            raise ValueError("attempt must be in [1, 1000000]")
        if len(body) > self.max_message_bytes - protocol.MAX_META_BYTES:
            raise ValueError(f"body of {len(body)} bytes exceeds the message limit")
        msg_id = self._new_id()
        request = protocol.Request(msg_id, service, float(budget_s), body, attempt)
        return self._send_call(request, service, budget_s)

    async def request(self, service: str, body: bytes, *, budget_s: float,
                      attempt: int = 1) -> bytes:
        """Send a REQUEST and wait for its REPLY body (partials are discarded)."""
        call = self.start(service, body, budget_s=budget_s, attempt=attempt)
        call._discard_partials = True
        try:
            return await call.result()
        except asyncio.CancelledError:
            self._cancel(call, FailureKind.CANCELLED, "caller was cancelled")
            raise

    async def status(self, *, timeout_s: float = 2.0) -> dict[str, Any]:
        """The broker's STATUS map (see docs/protocol.md)."""
        call = self._send_call(protocol.Status(self._new_id()), "", timeout_s)
        body = await call.result()
        data = protocol.unpack(body, max_bytes=self.max_message_bytes)
        if not isinstance(data, dict):
            raise BrokerUnavailable("broker answered STATUS with something that is not a map")
        return data

    # ------------------------------------------------------------------ internals

    def _running_socket(self) -> AsyncDealer:
        if self._sock is None or self._sock.closed:
            raise BrokerUnavailable("the client is not running (use 'async with BrokerClient')")
        return self._sock

    def _new_id(self) -> str:
        self._next_id += 1
        return f"{self._next_id:x}"

    def _send_call(self, msg: protocol.Request | protocol.Status, service: str,
                   budget_s: float) -> Call:
        sock = self._running_socket()
        call = Call(self, msg.request_id, service, time.monotonic() + budget_s + GRACE_S)
        self._calls[call.request_id] = call
        if not sock.send(protocol.encode(msg)):
            self._end(call, None, protocol.FailureReply(
                call.request_id, FailureKind.OVERLOADED,
                "the client's send queue is full (broker unreachable?)", True))
        return call

    def _end(self, call: Call, reply: bytes | None, failure: protocol.FailureReply | None) -> None:
        if self._calls.pop(call.request_id, None) is call:
            call._finish(reply, failure)

    def _cancel(self, call: Call, kind: str, message: str, *, retryable: bool = False) -> None:
        """Fail ``call`` locally now and tell the broker to cancel it (best effort)."""
        if call.done:
            return
        self._end(call, None, protocol.FailureReply(call.request_id, kind, message, retryable))
        sock = self._sock
        if sock is not None and not sock.closed:
            with contextlib.suppress(BrokerUnavailable):
                sock.send_message(protocol.Cancel(call.request_id))

    def _fail_all(self, kind: str, message: str) -> None:
        calls = list(self._calls.values())
        for call in calls:
            self._cancel(call, kind, message, retryable=True)
        if calls:
            log.warning("failed %d call(s) in flight: %s", len(calls), message)

    async def _reader(self) -> None:
        """Supervise the listener; ends with the error that stopped it. Cancelling
        this task stops dispatch at once (it cancels the awaited future)."""
        await self._running_socket().listen(self._on_batch)

    def _on_batch(self, batch: list[list[bytes]]) -> None:
        """Called by the socket's listener (a loop callback) with the messages read."""
        self._last_heard = time.monotonic()
        self._link_up = True
        max_bytes = self.max_message_bytes
        for msg in protocol.decode_batch(batch, max_bytes=max_bytes, dropped=self.dropped):
            self._on_message(msg, max_bytes)

    def _on_message(self, msg: protocol.Message, max_bytes: int) -> None:
        if isinstance(msg, protocol.Reply):
            call = self._calls.get(msg.request_id)
            if call is None:
                self.dropped["late_reply"] += 1
            else:
                self._end(call, msg.body, None)
        elif isinstance(msg, protocol.FailureReply):
            call = self._calls.get(msg.request_id)
            if call is None:
                # Expected after a local cancel: the broker's FAILURE(cancelled) ack.
                self.dropped["late_failure"] += 1
            else:
                self._end(call, None, msg)
        elif isinstance(msg, protocol.Partial):
            call = self._calls.get(msg.request_id)
            if call is None:
                self.dropped["late_partial"] += 1
                return
            problem = call._partial(msg.seq, msg.body, max_bytes)
            if problem == SLOW_CONSUMER:
                self._cancel(call, SLOW_CONSUMER,
                             "partials were not read fast enough; buffer bound reached")
            elif problem is not None:
                self._cancel(call, problem, f"partial {msg.seq} out of order")
        elif isinstance(msg, protocol.Heartbeat):
            if msg.peer_id and msg.peer_id != self._broker_id:
                if self._broker_id is not None:
                    self._fail_all(FailureKind.WORKER_LOST,
                                   f"broker restarted ({self._broker_id} -> {msg.peer_id})")
                self._broker_id = msg.peer_id
        else:
            self.dropped["wrong_direction"] += 1

    async def _heartbeat(self) -> None:
        sock = self._running_socket()
        beat = protocol.encode(protocol.Heartbeat(self.instance_id))
        window = self.heartbeat_interval_s * self.liveness
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            sock.send(beat)
            now = time.monotonic()
            heard = self._last_heard
            if (self._link_up and heard is not None and now - heard > window
                    and not sock.has_input()):
                self._link_up = False
                self._fail_all(FailureKind.WORKER_LOST,
                               f"broker silent for {now - heard:.2f}s")
            late = [c for c in self._calls.values() if c._deadline <= now]
            for call in late:
                self._cancel(call, FailureKind.TIMEOUT,
                             "no answer within the timeout (client-side deadline)",
                             retryable=True)
