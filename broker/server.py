"""The broker process's socket loop around the pure ``Dispatcher``.

A blocking loop over two ROUTER sockets, no asyncio (PERF.md: a tight
blocking loop comes within ~15 % of libzmq's C proxy; all-asyncio is about 2x
slower). It waits in ``select.poll`` on the sockets' ZMQ_FDs; each wake-up
drains every ready message (up to a batch per socket, so one side cannot
starve the other), then runs the timers; the poll timeout is the time to the
dispatcher's next timer. REQUESTs from clients and REPLYs from workers take a
hot path: only their metadata is decoded, into fields, and the payload frame
is forwarded as received.

Invariants:
- The loop blocks only when every socket's last operation was an EVENTS read
  (or a failed read) that found no input: a ZMQ_FD signals only new commands,
  and libzmq may process (and so consume) them during any send.
- No input can crash the loop or stop other traffic: decoding errors are
  counted by reason and dropped; an unexpected exception while handling one
  message is caught at the message boundary, counted (``internal_error``) and
  logged (rate-limited), and the loop carries on.
- Sends never block: ``ROUTER_MANDATORY`` plus ``NOBLOCK``. A full peer pipe
  (EAGAIN) holds the message in that peer's ordered backlog, retried at every
  wake-up (bounded in messages and bytes; past the bound it is dropped and
  counted); an unknown identity (EHOSTUNREACH) is counted and dropped.
- Every queue is bounded: socket HWMs here, request and queue limits in the
  dispatcher, and ``MAXMSGSIZE`` so libzmq refuses (by disconnecting the
  peer) any single frame far beyond the protocol limit before it is buffered.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import select
import time
from dataclasses import dataclass, field
from typing import Any, Final

import msgpack
import zmq

from broker import otel, protocol
from broker.faults import DELAY, DROP, DUPLICATE, FrameFaults
from broker.protocol import FailureKind
from broker.security import CurveServer, Guard
from broker.state import Dispatcher, Forward, Limits, Send, Side, new_broker_id
from broker.transport import readable, send_frames, send_routed

log = logging.getLogger(__name__)

BATCH: Final = 512  # messages drained per socket per wake-up
MAX_POLL_S: Final = 0.1  # wake at least this often to notice a stop request
HWM: Final = 20_000
# Messages held while a peer's pipe is full, across all peers (then dropped).
MAX_BACKLOG_MESSAGES: Final = 200_000
MAX_BACKLOG_BYTES: Final = 256 * 1024 * 1024
BACKLOG_RETRY_S: Final = 0.002
_Held = tuple[zmq.Socket[bytes], list[bytes], int]  # socket, frames, size
DROP_LOG_EVERY_S: Final = 5.0
_NB: Final = int(zmq.NOBLOCK)
_monotonic: Final = time.monotonic
_POLLIN: Final = int(zmq.POLLIN)
_CLIENT: Final = Side.CLIENT
_WORKER: Final = Side.WORKER
_HEADER: Final = protocol.HEADER
_REQUEST: Final = protocol.REQUEST_FRAME
_REPLY: Final = protocol.REPLY_FRAME
_request_fields: Final = protocol.request_fields
_reply_id: Final = protocol.reply_id
_request_frames: Final = protocol.request_frames
_reply_frames: Final = protocol.reply_frames
# Bits of ``Broker._unchecked``: sockets written to since their EVENTS were last read.
_FRONT: Final = 1
_BACK: Final = 2
_REQUEST_KINDS: Final = (bytes((protocol.Kind.REQUEST,)), bytes((protocol.Kind.STATUS,)))


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    frontend: str
    backend: str
    limits: Limits = field(default_factory=Limits)
    max_message_bytes: int = protocol.DEFAULT_MAX_MESSAGE_BYTES
    faults: FrameFaults | None = None  # chaos runs only (``--faults``)
    # CURVE + ZAP on the tcp:// endpoints (ipc:// stays plain); see broker/security.py.
    curve: CurveServer | None = None
    # Extra tcp:// endpoints bound with CURVE on the same sockets, besides plain ipc://
    # ones: libzmq takes CURVE options per bind, so earlier binds stay plain.
    frontend_tcp: str | None = None
    backend_tcp: str | None = None


# Request traffic the fault injector may touch, per side of the broker it arrives on.
# PARTIALs are left alone: a lost or reordered chunk fails its stream as `protocol`
# by design, which says nothing about the recovery paths the chaos run checks.
_FAULTABLE: Final = {
    Side.CLIENT: (protocol.Request,),
    Side.WORKER: (protocol.Reply, protocol.FailureReply),
}
MAX_DELAYED: Final = 10_000


class _DropLog:
    """Rate-limited warnings about dropped frames: at most one line per reason per period."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._since: dict[str, int] = {}

    def note(self, reason: str, detail: str = "") -> None:
        now = time.monotonic()
        self._since[reason] = self._since.get(reason, 0) + 1
        last = self._last.get(reason)
        if last is None or now - last >= DROP_LOG_EVERY_S:
            count = self._since.pop(reason)
            self._last[reason] = now
            log.warning("dropped %d frame(s): %s %s", count, reason, detail)


class Broker:
    """Binds the two ROUTER sockets and runs the poll loop until ``request_stop``."""

    def __init__(self, config: BrokerConfig, *, broker_id: str | None = None) -> None:
        self.config = config
        self.broker_id = broker_id or new_broker_id()
        self.state = Dispatcher(self.broker_id, config.limits, _monotonic())
        self._ctx = zmq.Context()
        # The ZAP socket is bound before any CURVE socket exists (else: no authentication).
        self.guard = Guard(self._ctx, config.curve) if config.curve is not None else None
        self._front = self._router()
        self._back = self._router()
        self._stopping = False
        self._drops = _DropLog()
        self._faults = config.faults
        # OpenTelemetry tracer (python -m broker sets it when traces are on).
        self.tracer: Any = None
        # The hot path (see _on_frontend) is off in chaos runs: faults act on messages.
        self._fast = config.faults is None
        # Metadata plus body at most this long keep a message within max_message_bytes.
        self._fast_limit = config.max_message_bytes - len(protocol.HEADER) - 1
        self._encode = protocol.Encoder()
        self._pack = self._encode.pack
        self._backlog: dict[tuple[Side, bytes], collections.deque[_Held]] = {}
        self._backlog_count = 0
        self._backlog_bytes = 0
        self._unchecked = _FRONT | _BACK  # see run()
        self._delayed: collections.deque[tuple[float, Side, bytes, protocol.Message]] = (
            collections.deque())
        self.frontend_endpoint = ""
        self.backend_endpoint = ""
        self.tcp_endpoints: dict[str, str] = {}

    def _router(self) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, HWM)
        sock.setsockopt(zmq.RCVHWM, HWM)
        # Headroom over the protocol limit so that slightly oversized messages
        # reach decode() and are counted; far larger frames are cut by libzmq.
        sock.setsockopt(zmq.MAXMSGSIZE,
                        self.config.max_message_bytes + protocol.MAX_META_BYTES + 1024)
        sock.setsockopt(zmq.LINGER, 0)
        return sock

    def bind(self) -> tuple[str, str]:
        """Bind both sockets; return the real endpoints (tcp port 0 resolved)."""
        if self.guard is not None:
            for sock, ep, domain in ((self._front, self.config.frontend, "frontend"),
                                     (self._back, self.config.backend, "backend")):
                if ep.startswith("tcp://"):
                    self.guard.secure(sock, domain)
        self._front.bind(self.config.frontend)
        self._back.bind(self.config.backend)
        self.frontend_endpoint = self._front.getsockopt_string(zmq.LAST_ENDPOINT)
        self.backend_endpoint = self._back.getsockopt_string(zmq.LAST_ENDPOINT)
        self.tcp_endpoints = self._bind_extra_tcp()
        return self.frontend_endpoint, self.backend_endpoint

    def _bind_extra_tcp(self) -> dict[str, str]:
        """Bind ``frontend_tcp``/``backend_tcp`` with CURVE; return side → real endpoint."""
        bound: dict[str, str] = {}
        for sock, ep, domain in ((self._front, self.config.frontend_tcp, "frontend"),
                                 (self._back, self.config.backend_tcp, "backend")):
            if ep is None:
                continue
            if self.guard is None or not ep.startswith("tcp://"):
                raise ValueError(f"{domain}_tcp needs a tcp:// endpoint and CURVE keys")
            self.guard.secure(sock, domain)
            sock.bind(ep)
            bound[domain] = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return bound

    def request_stop(self) -> None:
        """Ask the loop to stop at its next wake-up (safe from a signal handler)."""
        self._stopping = True

    def run(self) -> None:
        """Serve until ``request_stop``; then answer open requests and disconnect workers."""
        front, back, state = self._front, self._back, self.state
        guard = self.guard
        # select.poll on the sockets' ZMQ_FDs instead of zmq.Poller: zmq_poll makes a
        # first non-blocking pass and reads every socket's EVENTS before and after it
        # blocks; here a wake-up reads the socket that signalled at once, and asks
        # EVENTS of both sockets once, in one call, before blocking again.
        fds = select.poll()
        front_fd: int = front.get(zmq.FD)  # type: ignore[assignment]
        back_fd: int = back.get(zmq.FD)  # type: ignore[assignment]
        extras: dict[int, zmq.Socket[Any]] = {}
        for extra in guard.poll_sockets() if guard is not None else ():
            extras[extra.get(zmq.FD)] = extra  # type: ignore[index]
        for fd in (front_fd, back_fd, *extras):
            fds.register(fd, select.POLLIN)
        log.info("broker %s serving frontend=%s backend=%s", self.broker_id,
                 self.frontend_endpoint, self.backend_endpoint)
        delayed = self._delayed
        on_front, on_back = self._on_frontend, self._on_backend
        # EVENTS checks go through zmq_poll(items, 0): one call for both sockets, and
        # cheaper than Socket.get(EVENTS) even for one (get() builds an enum per call).
        checks = {_FRONT: [(front, _POLLIN)], _BACK: [(back, _POLLIN)],
                  _FRONT | _BACK: [(front, _POLLIN), (back, _POLLIN)]}
        fired = 0  # sockets to read from now (their fd signalled, or EVENTS said so)
        burst = 0  # ... of which EVENTS said so: read them until zmq.Again
        self._unchecked = _FRONT | _BACK
        pending_extras = list(extras.values())
        monotonic = time.monotonic
        front_first = (_FRONT, front, on_front), (_BACK, back, on_back)
        back_first = front_first[::-1]
        read = 0  # sockets read from in the previous round
        while not self._stopping:
            # A socket read from in the previous round goes first, so that its
            # waiting messages are handled before the other socket's, in order.
            for bit, sock, handle in back_first if read == _BACK else front_first:
                if fired & bit:
                    if self._drain(sock, handle, burst & bit):
                        self._unchecked |= bit  # read one message, or a batch cut short
                    else:
                        self._unchecked &= ~bit  # a read found the socket empty
            read = fired
            if pending_extras and guard is not None:
                for sock in pending_extras:
                    while readable(sock):
                        guard.on_ready(sock)
                pending_extras = []
            now = monotonic()
            while delayed and delayed[0][0] <= now:
                _, side, identity, msg = delayed.popleft()
                self._deliver(side, identity, msg, now)
            wake = state.next_wakeup()
            if now >= wake:
                self._perform(state.tick(now))
                wake = state.next_wakeup()
            if self._backlog:
                self._flush_backlog()
            fired = 0
            unchecked = self._unchecked
            if unchecked:
                # A socket just read from, or written to (libzmq may process commands,
                # and so consume the fd's signal, during a send): ask its EVENTS.
                self._unchecked = 0
                for ready, _ in zmq.zmq_poll(checks[unchecked], 0):
                    fired |= _FRONT if ready is front else _BACK
                if fired:
                    burst = fired
                    continue
            burst = 0
            if delayed and delayed[0][0] < wake:
                wake = delayed[0][0]
            wait_s = wake - now
            wait_s = 0.0 if wait_s < 0 else min(wait_s, MAX_POLL_S)
            if self._backlog:
                wait_s = min(wait_s, BACKLOG_RETRY_S)
            # Round up: poll(0) for a timer less than 1 ms away would spin.
            for fd, _ in fds.poll(math.ceil(wait_s * 1000)):
                if fd == front_fd:
                    fired |= _FRONT
                elif fd == back_fd:
                    fired |= _BACK
                elif fd in extras:
                    pending_extras.append(extras[fd])
        log.info("broker %s stopping", self.broker_id)
        self._perform(state.shutdown("broker shutting down"))

    def close(self, *, linger_s: float = 1.0) -> None:
        """Close the sockets, giving queued goodbyes ``linger_s`` to leave."""
        for sock in (self._front, self._back):
            sock.setsockopt(zmq.LINGER, int(linger_s * 1000))
            sock.close()
        if self.guard is not None:
            self.guard.close()
        self._ctx.term()

    # ------------------------------------------------------------------ input

    def _drain(self, sock: zmq.Socket[bytes], handle: Any, burst: int) -> bool:
        """Read and handle one message, or in a ``burst`` all waiting ones (up to
        ``BATCH``); return True if ``sock`` must be asked for EVENTS again.

        Reading must go on until a read attempt finds the socket empty: only then
        does libzmq signal its fd for the next message. Two ways to find out: ask
        EVENTS (a system call) or try to read (the same system call, plus a
        ``zmq.Again`` exception, about twice the cost). So at first read one
        message and leave the check to the loop, which asks both sockets in one
        call (one message per wake-up is the common case at low load). A socket
        still readable then is in a burst: read on until ``zmq.Again``, as
        libzmq's own proxy does, instead of asking EVENTS before every message."""
        recv = sock.recv
        for _ in range(BATCH if burst else 1):
            try:
                # A ROUTER's first frame is the peer's identity, and at least one
                # frame always follows it: read it as bytes, without a zmq.Frame.
                frames = [recv(_NB)]
                frame = recv(_NB, copy=False)
                frames.append(frame.bytes)
                while frame.more:
                    frame = recv(_NB, copy=False)
                    frames.append(frame.bytes)
            except zmq.Again:
                return False
            try:
                handle(frames)
            except Exception as exc:  # message boundary: one bad message never stops the loop
                self.state.drop("internal_error")
                self._drops.note("internal_error", repr(exc)[:200])
                log.debug("internal error handling a message", exc_info=True)
        return True

    def _decode(self, frames: list[bytes], side: str) -> protocol.Message | None:
        try:
            return protocol.decode(frames[1:], max_bytes=self.config.max_message_bytes)
        except protocol.VersionMismatch as exc:
            reason = "version_mismatch"
            if side == "client":
                self._salvage(frames, str(exc))
        except protocol.Oversized:
            reason = "oversized"
        except protocol.UnknownKind:
            reason = "unknown_kind"
        except protocol.ProtocolError:
            reason = "malformed"
        self.state.drop(reason)
        self._drops.note(reason, f"from {side} {bytes(frames[0][:40])!r}")
        return None

    def _on_frontend(self, frames: list[bytes]) -> None:
        if (len(frames) == 5 and frames[2] == _REQUEST and frames[1] == _HEADER
                and self._fast and len(frames[3]) + len(frames[4]) <= self._fast_limit):
            # The hot path: a REQUEST within the limits (everything else, including
            # any error, takes the general path below and is counted the same way).
            try:
                rid, service, budget_s, attempt = _request_fields(frames[3])
            except protocol.ProtocolError:
                pass
            else:
                body = frames[4]
                span = None
                if self.tracer is not None:
                    span, body = self._trace(service, body, attempt)
                got = self.state.on_request(frames[0], rid, service, budget_s, body, attempt,
                                            _monotonic())
                if span is not None:
                    span.set_attribute("corral.dispatched_at_once", isinstance(got, Forward))
                    span.end()
                if isinstance(got, Forward):
                    self._send(_WORKER, got.identity, _request_frames(
                        self._pack, got.request_id, service, got.budget_s, body, attempt))
                else:
                    self._perform(got)
                return
        if len(frames) < 2:
            self.state.drop("malformed")
            return
        msg = self._decode(frames, "client")
        if msg is None:
            return
        if self.tracer is not None and isinstance(msg, protocol.Request):
            span, body = self._trace(msg.service, msg.body, msg.attempt)
            if span is not None:
                span.end()
                msg = dataclasses.replace(msg, body=body)
        if self._faults is None:
            self._perform(self.state.on_client(frames[0], msg, _monotonic()))
        else:
            self._inject(Side.CLIENT, frames[0], msg)

    def _trace(self, service: str, body: bytes, attempt: int) -> tuple[Any, bytes]:
        """A ``broker dispatch`` span (``corral-broker``, the caller ends it) under
        the caller's span when the payload carries a trace context, and the body
        to forward: its traceparent now names that span, so the worker's span is
        the broker's child (``otel.with_parent``). Off: never called. Tracing is
        never a reason to lose a request: any failure here forwards the body as
        it came, without a span."""
        try:
            parent = otel.remote_parent(otel.traceparent_at_end(body))
            if parent is None:
                return None, body
            span = self.tracer.start_span("broker dispatch", context=parent, attributes={
                "corral.service": service, "corral.attempt": attempt})
            return span, otel.with_parent(body, span.get_span_context().span_id)
        except Exception:  # message boundary for trace context: never the broker's end
            log.exception("broker: a request's trace context could not be carried")
            return None, body

    def _on_backend(self, frames: list[bytes]) -> None:
        if (len(frames) == 5 and frames[2] == _REPLY and frames[1] == _HEADER
                and self._fast and len(frames[3]) + len(frames[4]) <= self._fast_limit):
            try:
                rid = _reply_id(frames[3])
            except protocol.ProtocolError:
                pass
            else:
                body = frames[4]
                got = self.state.on_reply(frames[0], rid, body, _monotonic())
                if isinstance(got, Forward):
                    self._send(_CLIENT, got.identity,
                               _reply_frames(self._pack, got.request_id, body))
                else:
                    self._perform(got)
                return
        if len(frames) < 2:
            self.state.drop("malformed")
            return
        msg = self._decode(frames, "worker")
        if msg is None:
            return
        if self._faults is None:
            self._perform(self.state.on_worker(frames[0], msg, _monotonic()))
        else:
            self._inject(Side.WORKER, frames[0], msg)

    def _deliver(self, side: Side, identity: bytes, msg: protocol.Message, now: float) -> None:
        if side is Side.CLIENT:
            self._perform(self.state.on_client(identity, msg, now))
        else:
            self._perform(self.state.on_worker(identity, msg, now))

    def _inject(self, side: Side, identity: bytes, msg: protocol.Message) -> None:
        """Chaos runs: drop, delay or duplicate request traffic as if on the wire."""
        faults = self._faults
        now = time.monotonic()
        action = faults.decide() if faults is not None and isinstance(
            msg, _FAULTABLE[side]) else None
        if action == DROP:
            self.state.count("fault_drop")
            return
        if action == DELAY and len(self._delayed) < MAX_DELAYED and faults is not None:
            self.state.count("fault_delay")
            self._delayed.append((now + faults.delay_s, side, identity, msg))
            return
        self._deliver(side, identity, msg, now)
        if action == DUPLICATE:
            self.state.count("fault_duplicate")
            self._deliver(side, identity, msg, now)

    def _salvage(self, frames: list[bytes], why: str) -> None:
        """Answer a request in another protocol version with FAILURE(protocol) if its id
        can be read; the failure itself is framed in our version."""
        if len(frames) < 4 or frames[2] not in _REQUEST_KINDS or len(frames[3]) > 4096:
            return
        try:
            meta = msgpack.unpackb(frames[3], raw=False)
        except Exception:  # foreign bytes: nothing to salvage
            return
        rid = meta.get("id") if isinstance(meta, dict) else None
        if isinstance(rid, str) and 0 < len(rid) <= protocol.MAX_ID_CHARS:
            failure = protocol.FailureReply(rid, FailureKind.PROTOCOL, why, False)
            self._perform([Send(Side.CLIENT, frames[0], failure)])

    # ------------------------------------------------------------------ output

    def _perform(self, actions: list[Send]) -> None:
        encode = self._encode
        send = self._send
        for side, identity, msg in actions:
            send(side, identity, encode(msg))

    def _send(self, side: Side, identity: bytes, frames: list[bytes]) -> None:
        """Send ``frames`` to the peer ``identity`` on the ``side`` socket, without
        blocking: held in the peer's backlog if its pipe is full, counted and
        dropped if the peer is unknown."""
        if side is _CLIENT:
            sock = self._front
            self._unchecked |= _FRONT
        else:
            sock = self._back
            self._unchecked |= _BACK
        backlog = self._backlog
        if backlog and (side, identity) in backlog:
            # Keep the peer's order: once one message waits, the rest wait too.
            self._hold(side, identity, sock, frames)
            return
        try:
            send_routed(sock, identity, frames)
        except zmq.Again:
            # The peer's pipe is full for now (a slow reader, a burst): hold the
            # message, bounded, and retry each wake-up, instead of dropping an
            # answer the caller would then wait for until its deadline.
            self._hold(side, identity, sock, frames)
        except zmq.ZMQError as exc:
            reason = "unroutable" if exc.errno == zmq.EHOSTUNREACH else "send_error"
            self.state.drop(reason)
            self._drops.note(reason, f"to {side.value}: {exc}")

    def _hold(self, side: Side, identity: bytes, sock: zmq.Socket[bytes],
              frames: list[bytes]) -> None:
        frames = [identity, *frames]
        size = sum(len(f) for f in frames)
        if (self._backlog_count >= MAX_BACKLOG_MESSAGES
                or self._backlog_bytes + size > MAX_BACKLOG_BYTES):
            self.state.drop("send_would_block")
            self._drops.note("send_would_block", f"to {side.value} (backlog full)")
            return
        self._backlog.setdefault((side, identity), collections.deque()).append(
            (sock, frames, size))
        self._backlog_count += 1
        self._backlog_bytes += size

    def _flush_backlog(self) -> None:
        """Retry held messages in order, per peer, until a pipe is full again."""
        for key in list(self._backlog):
            queue = self._backlog[key]
            self._unchecked |= _FRONT if key[0] is Side.CLIENT else _BACK
            while queue:
                sock, frames, size = queue[0]
                try:
                    send_frames(sock, frames)
                except zmq.Again:
                    break
                except zmq.ZMQError as exc:  # the peer is gone: drop what it had waiting
                    reason = "unroutable" if exc.errno == zmq.EHOSTUNREACH else "send_error"
                    for _ in range(len(queue)):
                        self.state.drop(reason)
                    self._drops.note(reason, f"to {key[0].value}: {exc}")
                    self._backlog_count -= len(queue)
                    self._backlog_bytes -= sum(item[2] for item in queue)
                    queue.clear()
                    break
                queue.popleft()
                self._backlog_count -= 1
                self._backlog_bytes -= size
            if not queue:
                del self._backlog[key]
