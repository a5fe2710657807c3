"""The asyncio adapter around one ZeroMQ DEALER socket, shared by client and worker.

A plain (blocking-API) pyzmq socket driven from the running event loop with
``loop.add_reader`` on the socket's notification fd: one reader drains every
ready message per wake-up, and sends are synchronous NOBLOCK calls, so no
future or task is created per message (PERF.md: draining doubles throughput,
``zmq.asyncio`` per-message futures cost about 2x).

This is the one boundary where pyzmq errors are translated: ``zmq.ZMQError``
becomes ``BrokerUnavailable``; a full send pipe is reported as ``False``.

Invariants:
- The zmq fd is edge-triggered: after every send, and before every wait, the
  socket's ``EVENTS`` are re-read so that a message that arrived while a send
  consumed the edge is never left unread.
- All queues are bounded: SNDHWM/RCVHWM on the socket, ``MAXMSGSIZE`` on input.
- Only the event loop thread touches the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Final

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
        self._loop.add_reader(self._fd, self._readable.set)
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def has_input(self) -> bool:
        """A message is waiting to be read (the reader has not caught up)."""
        return not self._closed and readable(self._sock)

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
                self._readable.set()
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

    async def recv_batch(self, limit: int = 512) -> list[list[bytes]]:
        """Wait until at least one message is ready; return up to ``limit`` of them."""
        while True:
            if self._closed:
                raise BrokerUnavailable("socket is closed")
            batch = self._drain(limit)
            if batch:
                return batch
            self._readable.clear()
            if readable(self._sock):
                continue
            await self._readable.wait()

    def close(self, *, linger_s: float = 0.0) -> None:
        """Close; ``linger_s`` lets already-queued messages (a goodbye) leave in the
        background (the shared context is never terminated, so this never blocks)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):  # the loop may already be closed
            self._loop.remove_reader(self._fd)
        self._sock.close(linger=int(linger_s * 1000))
        self._readable.set()
