"""The asyncio adapter around one ZeroMQ DEALER socket, shared by client and worker.

A plain (blocking-API) pyzmq socket driven from the running event loop with
``loop.add_reader`` on the socket's notification fd, and synchronous NOBLOCK
sends, so no future or task is created per message (PERF.md: draining doubles
throughput, ``zmq.asyncio`` per-message futures cost about 2x).

Two ways to read, one at a time:
- ``listen(on_batch)``: the fd's reader callback itself drains the socket and
  calls ``on_batch`` synchronously, so a message is dispatched in the same
  loop iteration in which its fd became readable (no task wake-up between
  them: one loop iteration less per receive, ~80 µs less per API round trip
  on the 2-core VM, see docs/protocol.md). ``BrokerClient`` and
  ``BrokerWorker`` use it.
- ``recv_batch()``: the callback sets an Event that a reader task awaits.

This is the one boundary where pyzmq errors are translated: ``zmq.ZMQError``
becomes ``BrokerUnavailable``; a full send pipe is reported as ``False``.

Invariants:
- The zmq fd is edge-triggered: after every send, after ``has_input``, after
  every drain and before every wait, the socket's ``EVENTS`` are re-read, and a
  message found waiting is read (the listener is scheduled again with
  ``call_soon``; the Event is set), so a message that arrived while a send or
  an EVENTS query consumed the edge is never left unread.
- A listener callback reads at most ``limit`` messages, then yields to the loop
  (``call_soon``) if more are waiting: it never starves the loop.
- Nothing but SystemExit/KeyboardInterrupt raises out of the listener callback
  (asyncio would only log it, and reading would silently stop): a receive
  error or an exception from ``on_batch`` ends the listening future with that
  error, and dispatch stops.
  Dispatch happens only while that future is pending, so cancelling it (or the
  task awaiting it) stops dispatch at once; ``close`` ends it with
  ``BrokerUnavailable`` and removes the reader.
- All queues are bounded: SNDHWM/RCVHWM on the socket, ``MAXMSGSIZE`` on input.
- Only the event loop thread touches the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import Callable
from typing import Any, Final, TypeAlias

import zmq

from broker import protocol
from broker.errors import BrokerUnavailable
from broker.security import CurveClient

HWM: Final = 20_000
# Plain ints: pyzmq's send_multipart/recv_multipart combine IntFlag enums per frame,
# which costs more than the libzmq calls themselves for our small frames.
_MORE_NB: Final = int(zmq.SNDMORE | zmq.NOBLOCK)
_NB: Final = int(zmq.NOBLOCK)
EVENTS_OPT: Final = int(zmq.EVENTS)
POLLIN_FLAG: Final = int(zmq.POLLIN)
BATCH: Final = 512  # messages read per wake-up / listener callback at most

BatchHandler: TypeAlias = Callable[[list[list[bytes]]], None]


# The libzmq-level send of pyzmq's Cython socket, skipping the Python wrapper that
# handles DRAFT routing_id/group arguments we never use (about 1 µs per message).
_base_send: Any = next(
    (c.__dict__["send"] for c in zmq.Socket.__mro__[1:] if "send" in c.__dict__),
    zmq.Socket.send,
)


def send_frames(sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
    """Send a multipart message without blocking; raises ``zmq.Again`` if the pipe is full."""
    send = _base_send
    for frame in frames[:-1]:
        send(sock, frame, _MORE_NB)
    send(sock, frames[-1], _NB)


def send_routed(sock: zmq.Socket[bytes], identity: bytes, frames: list[bytes]) -> None:
    """``send_frames(sock, [identity, *frames])`` on a ROUTER, without building that
    list. With ROUTER_MANDATORY, a full pipe (``zmq.Again``) or an unknown peer
    (EHOSTUNREACH) is raised on the identity frame, before any frame is queued."""
    send = _base_send
    send(sock, identity, _MORE_NB)
    for frame in frames[:-1]:
        send(sock, frame, _MORE_NB)
    send(sock, frames[-1], _NB)


def readable(sock: zmq.Socket[bytes]) -> bool:
    """A message is waiting on ``sock`` (ZMQ_EVENTS; also processes pending commands)."""
    events: int = sock.get(EVENTS_OPT)  # type: ignore[assignment]
    return bool(events & POLLIN_FLAG)


def recv_frames(sock: zmq.Socket[bytes]) -> list[bytes]:
    """Receive one multipart message without blocking; raises ``zmq.Again`` if none.

    Reads ``zmq.Frame``s for their C-level ``more`` flag (getsockopt(RCVMORE)
    converts the option to an enum on every call) and copies out the bytes.
    """
    recv = sock.recv
    frame = recv(_NB, copy=False)
    frames: list[bytes] = [frame.bytes]
    while frame.more:
        frame = recv(_NB, copy=False)
        frames.append(frame.bytes)
    return frames


class AsyncDealer:
    """One connected DEALER socket used from one asyncio loop."""

    def __init__(self, endpoint: str, *, identity: bytes,
                 max_message_bytes: int = protocol.DEFAULT_MAX_MESSAGE_BYTES,
                 curve: CurveClient | None = None) -> None:
        self.endpoint = endpoint
        self._loop = asyncio.get_running_loop()
        self._readable = asyncio.Event()
        # listen(): the handler, its future (dispatch only while it is pending),
        # the per-callback bound, the context its callbacks run in, and whether a
        # call_soon of the listener is already pending.
        self._on_batch: BatchHandler | None = None
        self._listening: asyncio.Future[None] | None = None
        self._limit = BATCH
        self._context: contextvars.Context | None = None
        self._pump_pending = False
        try:
            sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, identity)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, HWM)
            sock.setsockopt(zmq.RCVHWM, HWM)
            sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + protocol.MAX_META_BYTES + 1024)
            sock.setsockopt(zmq.RECONNECT_IVL, 50)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            if curve is not None and endpoint.startswith("tcp://"):
                curve.apply(sock)  # ipc:// stays plain (broker/security.py)
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            raise BrokerUnavailable(f"cannot connect to {endpoint}: {exc}") from exc
        self._sock = sock
        self._fd: int = sock.getsockopt(zmq.FD)  # type: ignore[assignment]
        self._loop.add_reader(self._fd, self._on_fd)
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def has_input(self) -> bool:
        """A message is waiting to be read (the reader has not caught up)."""
        if self._closed:
            return False
        if readable(self._sock):
            self._wake()  # this EVENTS query may have consumed the fd's edge
            return True
        return False

    def send(self, frames: list[bytes]) -> bool:
        """Send now without blocking; ``False`` when the outgoing pipe is full."""
        if self._closed:
            raise BrokerUnavailable("socket is closed")
        sock = self._sock
        try:
            send_frames(sock, frames)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            raise BrokerUnavailable(f"send failed: {exc}") from exc
        finally:
            # A send may have consumed the fd's edge for an incoming message.
            if not self._closed and readable(sock):
                self._wake()
        return True

    def send_message(self, msg: protocol.Message) -> bool:
        return self.send(protocol.encode(msg))

    async def send_waiting(self, frames: list[bytes], *, deadline: float) -> bool:
        """Send, waiting (with backoff) while the pipe is full, until ``deadline``."""
        delay_s = 0.0005
        while not self.send(frames):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await asyncio.sleep(min(delay_s, left))
            delay_s = min(delay_s * 2, 0.05)
        return True

    def _drain(self, limit: int) -> list[list[bytes]]:
        batch: list[list[bytes]] = []
        sock = self._sock
        try:
            for i in range(limit):
                # EVENTS before each further read is cheaper than a failing recv.
                if i and not readable(sock):
                    break
                batch.append(recv_frames(sock))
        except zmq.Again:
            pass
        except zmq.ZMQError as exc:
            raise BrokerUnavailable(f"receive failed: {exc}") from exc
        return batch

    async def recv_batch(self, limit: int = BATCH) -> list[list[bytes]]:
        """Wait until at least one message is ready; return up to ``limit`` of them."""
        while True:
            if self._closed:
                raise BrokerUnavailable("socket is closed")
            if self._is_listening():
                raise RuntimeError("recv_batch() while a listener reads this socket")
            batch = self._drain(limit)
            if batch:
                return batch
            self._readable.clear()
            if readable(self._sock):
                continue
            await self._readable.wait()

    # ------------------------------------------------------------------ listen

    def listen(self, on_batch: BatchHandler, *, limit: int = BATCH) -> asyncio.Future[None]:
        """Dispatch every received message from the fd's reader callback:
        ``on_batch(messages)`` is called synchronously with up to ``limit``
        messages (each a list of frames) as soon as they are readable.

        Returns a future that is pending while listening; await it from a
        supervising task. It ends with the error that stopped reading (a
        ``BrokerUnavailable`` receive error or close, or whatever ``on_batch``
        raised). Cancelling it, or the task awaiting it, stops dispatch at once.
        """
        if self._closed:
            raise BrokerUnavailable("socket is closed")
        if self._is_listening():
            raise RuntimeError("this socket already has a listener")
        if limit < 1:
            raise ValueError("limit must be >= 1")
        self._on_batch = on_batch
        self._limit = limit
        self._context = contextvars.copy_context()
        self._listening = self._loop.create_future()
        # Messages that arrived before listening: their edge may be gone.
        self._schedule_pump()
        return self._listening

    def _is_listening(self) -> bool:
        return self._listening is not None and not self._listening.done()

    def _wake(self) -> None:
        """Input is waiting but its edge may be consumed: make sure it gets read."""
        if self._is_listening():
            self._schedule_pump()
        else:
            self._readable.set()

    def _schedule_pump(self) -> None:
        if not self._pump_pending:
            self._pump_pending = True
            self._loop.call_soon(self._pump_soon, context=self._context)

    def _pump_soon(self) -> None:
        self._pump_pending = False
        if not self._closed and self._is_listening():
            self._pump()

    def _on_fd(self) -> None:
        """The loop's reader callback for the zmq fd."""
        if self._closed:
            return
        if self._is_listening():
            self._pump()
        else:
            self._readable.set()

    def _pump(self) -> None:
        """Read and dispatch up to ``limit`` messages; never raises."""
        on_batch = self._on_batch
        listening = self._listening
        if on_batch is None or listening is None:
            return
        budget = self._limit
        try:
            while True:
                # An empty drain means its recv found nothing (a spurious wake-up,
                # or commands only): that recv re-armed the fd's edge.
                batch = self._drain(budget)
                if not batch:
                    return
                on_batch(batch)
                if listening.done() or self._closed:
                    return  # on_batch stopped the listener or closed the socket
                budget -= len(batch)
                # Re-read EVENTS after dispatch (its sends may have taken the edge).
                if not readable(self._sock):
                    return
                if budget <= 0:
                    self._schedule_pump()  # more is waiting: yield to the loop first
                    return
        except (SystemExit, KeyboardInterrupt):
            self._stop_listening(BrokerUnavailable("reader interrupted"))
            raise
        except BaseException as exc:  # the callback boundary: asyncio would only log it
            # A future refuses StopIteration (TypeError): wrapped, like BaseExceptions.
            error = exc if isinstance(exc, Exception) and not isinstance(exc, StopIteration) \
                else RuntimeError(f"the message handler raised {exc!r}")
            if error is not exc:
                error.__cause__ = exc
            self._stop_listening(error)

    def _stop_listening(self, error: Exception) -> None:
        listening = self._listening
        if listening is not None and not listening.done():
            listening.set_exception(error)
        self._on_batch = None

    def close(self, *, linger_s: float = 0.0) -> None:
        """Close; ``linger_s`` lets already-queued messages (a goodbye) leave in the
        background (the shared context is never terminated, so this never blocks).
        A listener's future ends with ``BrokerUnavailable``."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):  # the loop may already be closed
            self._loop.remove_reader(self._fd)
        self._sock.close(linger=int(linger_s * 1000))
        self._stop_listening(BrokerUnavailable("socket is closed"))
        self._readable.set()
