"""The public asyncio client of the supervisor (used by the ``corral`` CLI).

Example::

    async with SupervisorClient("ipc:///home/me/.corral/supervisor.sock") as sv:
        sid = await sv.create_session(route="main", workspace="/work/proj")
        await sv.submit(sid, {"type": "user_input", "text": "list the files"})
        async for event in sv.events(sid):
            print(event["type"])
            if event["type"] in ("turn_complete", "turn_aborted"):
                break

Invariants:
- Every call has a deadline (``timeout_s``); a silent supervisor raises
  ``SupervisorUnavailable`` instead of hanging the caller.
- ``events`` never shows a sequence twice and never skips one: after a
  supervisor restart or a dropped subscription it resubscribes from the last
  sequence it delivered. Events without a sequence are live-only extras
  (streamed deltas) and are passed through as they come.

Exception tree::

    SupervisorError(kind, message)     the supervisor answered with an error
    └── SupervisorUnavailable          no answer within the deadline
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from broker.errors import BrokerUnavailable
from broker.security import CurveClient
from broker.transport import AsyncDealer
from supervisor import wire

log = logging.getLogger(__name__)

_EVENT_QUEUE_BOUND = 10_000
_DRAIN_BATCH = 256  # messages handled per wake-up before yielding
_MAX_PEERS = 16  # other supervisors one client follows redirects to


class SupervisorError(Exception):
    def __init__(self, kind: str, message: str, address: str | None = None) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message
        self.address = address  # kind "moved": the owning supervisor's client endpoint


class SupervisorUnavailable(SupervisorError):
    def __init__(self, message: str) -> None:
        super().__init__(wire.ErrorKind.UNAVAILABLE, message)


class _Subscription:
    def __init__(self, session_id: str, after_sequence: int) -> None:
        self.session_id = session_id
        self.last_sequence = after_sequence
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(_EVENT_QUEUE_BOUND)
        self.sub_id: int | None = None
        # Since when following the session to its owner has failed with no event
        # delivered (None: not failing): bounds the redirect rounds.
        self.failing_since: float | None = None


class SupervisorClient:
    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float = 10.0,
        liveness_s: float = 3.0,
        curve: CurveClient | None = None,
        follow_redirects: bool = True,
    ) -> None:
        self.endpoint = endpoint
        # A session owned by another supervisor of the farm is answered "moved" with
        # its owner's address; calls and subscriptions for it go there (one hop).
        self.follow_redirects = follow_redirects
        self._peers: dict[str, SupervisorClient] = {}
        self._peer_stack = contextlib.AsyncExitStack()
        self.curve = curve  # CURVE keys towards a tcp:// supervisor (docs/multihost.md)
        self.timeout_s = timeout_s
        self.liveness_s = liveness_s
        self._sock: AsyncDealer | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._subs: dict[int, _Subscription] = {}
        # Per server subscription: the highest sequence it sent (at first, the
        # after_sequence asked). An event at or below it was sent again by the server
        # within one subscription: dropped here, but counted (``resent_events``) so a
        # checker can tell a server that replays what it already delivered.
        self._wire_last: dict[int, int] = {}
        self.resent_events = 0
        self._server_id: str | None = None
        self._last_heard = time.monotonic()
        self._tg: asyncio.TaskGroup | None = None
        self._reader: asyncio.Task[None] | None = None
        self._beater: asyncio.Task[None] | None = None
        self._beat_s = min(0.5, liveness_s / 3)
        # Client tools and hooks (supervisor.sdk): pushed calls and cancels go to
        # ``on_push`` (called from the read loop: it must not block), and
        # ``on_reconnect`` runs when the supervisor restarted or went silent.
        self.on_push: Callable[[dict[str, Any]], None] | None = None
        self.on_reconnect: Callable[[], None] | None = None

    async def __aenter__(self) -> SupervisorClient:
        self._connect()
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        self._reader = self._tg.create_task(self._read_loop())
        self._beater = self._tg.create_task(self._heartbeat_loop())
        # Learn the server instance now: a restart before its first heartbeat
        # must still be noticed (every message carries the instance id).
        with contextlib.suppress(SupervisorError):
            await self.call("hello", timeout_s=min(self.timeout_s, 5.0))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._peer_stack.aclose()
        if self._reader is not None:
            self._reader.cancel()
        if self._beater is not None:
            self._beater.cancel()
        if self._tg is not None:
            await self._tg.__aexit__(None, None, None)
        if self._sock is not None:
            self._sock.close()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(SupervisorUnavailable("client closed"))

    def _connect(self) -> None:
        """(Re)open the DEALER. The transport is the broker's ``AsyncDealer``: an
        edge-trigger-safe reader on the zmq fd with non-blocking sends."""
        if self._sock is not None:
            self._sock.close()
        self._sock = AsyncDealer(self.endpoint, identity=os.urandom(8),
                                 max_message_bytes=wire.MAX_MESSAGE_BYTES, curve=self.curve)

    async def _send(self, msg: dict[str, Any]) -> None:
        """Send now or fail: with no connected peer a DEALER would block, and
        nothing here may wait on the supervisor without a deadline."""
        if self._sock is None:
            raise SupervisorUnavailable("not connected")
        try:
            sent = self._sock.send(wire.encode(msg))
        except BrokerUnavailable as exc:
            raise SupervisorUnavailable(str(exc)) from None
        if not sent:
            raise SupervisorUnavailable(f"the supervisor at {self.endpoint} is not "
                                        "reachable right now")

    async def call(self, name: str, timeout_s: float | None = None, **args: Any) -> Any:
        """Make one call; raises ``SupervisorError`` or ``SupervisorUnavailable``. A
        ``moved`` answer is followed once, to the owning supervisor."""
        try:
            return await self._call_here(name, timeout_s, **args)
        except SupervisorError as exc:
            if exc.kind != wire.ErrorKind.MOVED or not self.follow_redirects \
                    or exc.address is None:
                raise
            peer = await self._peer(exc.address)
            if name == "create_session":
                args["placed"] = True  # placed by load: the peer creates it
            return await peer.call(name, timeout_s, **args)

    async def _peer(self, address: str) -> SupervisorClient:
        """A client of another supervisor of the farm (same keys, no further redirects),
        kept for this client's lifetime; at most ``_MAX_PEERS``."""
        peer = self._peers.get(address)
        if peer is None:
            if len(self._peers) >= _MAX_PEERS:
                raise SupervisorError(wire.ErrorKind.UNAVAILABLE, f"redirected to {address}, "
                                      f"but {_MAX_PEERS} other supervisors are already open")
            peer = SupervisorClient(address, timeout_s=self.timeout_s,
                                    liveness_s=self.liveness_s, curve=self.curve,
                                    follow_redirects=False)
            await self._peer_stack.enter_async_context(peer)
            self._peers[address] = peer
        return peer

    async def _call_here(self, name: str, timeout_s: float | None = None, **args: Any) -> Any:
        call_id = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = fut
        try:
            await self._send({"id": call_id, "call": name, "args": args})
            async with asyncio.timeout(timeout_s or self.timeout_s):
                return await fut
        except TimeoutError:
            raise SupervisorUnavailable(
                f"no answer from the supervisor at {self.endpoint} within "
                f"{timeout_s or self.timeout_s:.1f}s; is the farm up? (corral status)"
            ) from None
        finally:
            self._pending.pop(call_id, None)

    async def _read_loop(self) -> None:
        """Drain what is ready, a bounded batch per wake-up, so a busy stream of
        events never starves the heartbeat task or the callers."""
        while True:
            sock = self._sock
            assert sock is not None
            try:
                batch = await sock.recv_batch(_DRAIN_BATCH)
            except BrokerUnavailable:
                await asyncio.sleep(0.01)  # the socket was replaced; read the new one
                continue
            self._last_heard = time.monotonic()
            for frames in batch:
                try:
                    msg = wire.decode(frames)
                except wire.WireError as exc:
                    log.warning("dropped a bad message from the supervisor: %s", exc)
                    continue
                await self._dispatch(msg)
            await asyncio.sleep(0)

    async def _heartbeat_loop(self) -> None:
        """Our liveness for the server (it drops the subscriptions of clients it
        has not heard from), and the server's for us, on their own timer."""
        while True:
            await asyncio.sleep(self._beat_s)
            if time.monotonic() - self._last_heard > self.liveness_s:
                # Lazy Pirate: a silent server gets a fresh socket, so nothing
                # queued for the dead connection can hold up the new one.
                self._connect()
                await self._on_supervisor_lost("silent")
                self._last_heard = time.monotonic()
            with contextlib.suppress(SupervisorUnavailable):
                await self._send({"id": 0, "call": "ping", "args": {}})

    async def _dispatch(self, msg: dict[str, Any]) -> None:
        server_id = msg.get("srv")
        if isinstance(server_id, str) and server_id != self._server_id:
            if self._server_id is not None:
                await self._on_supervisor_lost("restarted")
            self._server_id = server_id
        if "hb" in msg:
            return
        if "dropped" in msg:  # the server gave up on us (silent too long): start over
            await self._on_supervisor_lost("dropped us")
            return
        if "client_call" in msg or "client_cancel" in msg:
            if self.on_push is not None:
                self.on_push(msg)
            return
        if "sub" in msg:
            sub = self._subs.get(msg["sub"])
            if sub is None:
                return
            if "event" in msg:
                event = msg["event"]
                seq = event.get("sequence")
                if isinstance(seq, int) and seq > 0:  # 0: a live-only delta
                    sent = self._wire_last.get(msg["sub"])
                    if sent is not None:
                        if seq <= sent:
                            self.resent_events += 1
                        self._wire_last[msg["sub"]] = max(sent, seq)
                    if seq <= sub.last_sequence:
                        return  # already delivered (resubscribe overlap)
                    sub.last_sequence = seq
                await sub.queue.put(event)
            elif "end" in msg:
                self._subs.pop(msg["sub"], None)
                self._wire_last.pop(msg["sub"], None)
                await sub.queue.put({"type": "__end__", **msg["end"]})
            return
        fut = self._pending.get(msg.get("id", -1))
        if fut is None or fut.done():
            return
        if msg.get("ok"):
            fut.set_result(msg.get("result"))
        else:
            err = msg.get("error") or {}
            address = err.get("address")
            fut.set_exception(SupervisorError(str(err.get("kind", "internal")),
                                              str(err.get("message", "")),
                                              address if isinstance(address, str) else None))

    async def _on_supervisor_lost(self, why: str) -> None:
        log.info("supervisor %s; resubscribing %d subscription(s)", why, len(self._subs))
        if self.on_reconnect is not None:
            self.on_reconnect()
        subs = list(self._subs.values())
        self._subs.clear()
        for sub in subs:
            # Tell the iterator to resubscribe from its last sequence.
            await sub.queue.put({"type": "__end__", "kind": "resubscribe", "message": why})

    @property
    def server_id(self) -> str | None:
        """The instance id of the supervisor this client last heard from."""
        return self._server_id

    def subscribed(self, session_id: str) -> bool:
        """Whether an event subscription to ``session_id`` stands on the server
        instance last heard (one dropped on a restart is not listed), or on the
        supervisor it was redirected to (its owner)."""
        return any(s.session_id == session_id and s.sub_id is not None
                   for s in self._subs.values()) or any(
                       p.subscribed(session_id) for p in self._peers.values())

    # -- convenience calls -------------------------------------------------

    async def create_session(self, **spec: Any) -> str:
        return str(await self.call("create_session", spec=spec))

    async def submit(self, session_id: str, op: dict[str, Any]) -> str:
        return str(await self.call("submit", session_id=session_id, op=op))

    async def list_sessions(self, **kw: Any) -> Any:
        return await self.call("list_sessions", **kw)

    async def describe(self, session_id: str) -> Any:
        return await self.call("describe", session_id=session_id)

    async def status(self) -> Any:
        return await self.call("status")

    async def export(self, session_id: str) -> Any:
        """The session's latest portable checkpoint: ``{"checkpoint": doc, "source"}``."""
        return await self.call("export", session_id=session_id)

    async def history(self, session_id: str, *, after_sequence: int = 0,
                      limit: int = 500) -> Any:
        return await self.call("history", session_id=session_id,
                               after_sequence=after_sequence, limit=limit)

    async def _events_at(self, address: str, sub: _Subscription,
                         reconnect_timeout_s: float) -> AsyncIterator[dict[str, Any]]:
        """The session's events from the supervisor that owns it, from ``sub``'s last
        sequence, until it no longer owns it (``moved`` or ``unknown_session`` there):
        then the caller resubscribes here, which redirects to the new owner."""
        peer = await self._peer(address)
        # An owner that stops answering (it died, or is paused) is given a short time;
        # then the first supervisor is asked again: once the dead owner's lease lapsed
        # it names the new owner (or holds the subscription until there is one).
        peer_timeout_s = min(reconnect_timeout_s, max(2.0, self.liveness_s))
        delivered = False
        try:
            async for event in peer.events(sub.session_id, after_sequence=sub.last_sequence,
                                           reconnect_timeout_s=peer_timeout_s):
                delivered = True
                sub.failing_since = None
                seq = event.get("sequence")
                if isinstance(seq, int) and seq > 0:
                    sub.last_sequence = seq
                yield event
        except SupervisorError as exc:
            if exc.kind not in (wire.ErrorKind.MOVED, wire.ErrorKind.UNKNOWN_SESSION,
                                wire.ErrorKind.BETWEEN_OWNERS, wire.ErrorKind.UNAVAILABLE):
                raise
            now = time.monotonic()
            if delivered or sub.failing_since is None:
                sub.failing_since = now
            elif now - sub.failing_since > reconnect_timeout_s:
                raise SupervisorUnavailable(
                    f"session {sub.session_id}: no supervisor served it for "
                    f"{reconnect_timeout_s:.0f}s (last asked: {address}: {exc})") from None
            await asyncio.sleep(0.1)  # the lease is changing hands: do not spin

    async def _subscribe(self, sub: _Subscription, reconnect_timeout_s: float) -> int:
        """(Re)subscribe ``sub``; its id is registered before the call is sent so no
        event that follows the answer can arrive for an unknown subscription."""
        deadline = time.monotonic() + reconnect_timeout_s
        delay_s = 0.05
        while True:
            sub_id = next(self._ids)
            self._subs[sub_id] = sub
            self._wire_last[sub_id] = sub.last_sequence
            try:
                # Here, never redirected: the events come on this connection.
                await self._call_here("subscribe", timeout_s=min(self.timeout_s, 2.0),
                                session_id=sub.session_id, after_sequence=sub.last_sequence,
                                sub=sub_id)
                return sub_id
            except SupervisorUnavailable:
                self._subs.pop(sub_id, None)
                self._wire_last.pop(sub_id, None)
                # A slow server may still take the subscribe after our deadline:
                # withdraw it, or each retry would leave one behind (the server's
                # calls start in arrival order, so this lands after it).
                with contextlib.suppress(SupervisorError):
                    await self._send({"id": 0, "call": "unsubscribe", "args": {"sub": sub_id}})
                if time.monotonic() + delay_s > deadline:
                    raise
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, 1.0)
            except BaseException:
                self._subs.pop(sub_id, None)
                self._wire_last.pop(sub_id, None)
                raise

    async def events(
        self, session_id: str, *, after_sequence: int = 0, reconnect_timeout_s: float = 60.0
    ) -> AsyncIterator[dict[str, Any]]:
        """Durable history after ``after_sequence``, then live events, forever.

        Survives supervisor restarts and dropped subscriptions by resubscribing
        from the last delivered sequence; follows a session to its new owner
        (``moved``), and resubscribes while it is ``between_owners`` for up to
        ``reconnect_timeout_s``.
        """
        sub = _Subscription(session_id, after_sequence)
        unowned_since: float | None = None  # the session between owners since then
        try:
            while True:
                if sub.sub_id is None:
                    try:
                        sub.sub_id = await self._subscribe(sub, reconnect_timeout_s)
                    except SupervisorError as exc:
                        if exc.kind != wire.ErrorKind.MOVED or exc.address is None \
                                or not self.follow_redirects:
                            raise
                        async for moved in self._events_at(exc.address, sub,
                                                           reconnect_timeout_s):
                            yield moved
                        continue
                event = await sub.queue.get()
                if event.get("type") == "__end__":
                    kind = event.get("kind")
                    if kind in ("resubscribe", wire.ErrorKind.SLOW_CONSUMER):
                        sub.sub_id = None
                        continue
                    if kind == wire.ErrorKind.BETWEEN_OWNERS:
                        # Held by the supervisor, still no owner: again from the last
                        # sequence, within the reconnect deadline.
                        now = time.monotonic()
                        unowned_since = unowned_since if unowned_since is not None else now
                        if now - unowned_since < reconnect_timeout_s:
                            sub.sub_id = None
                            await asyncio.sleep(0.2)
                            continue
                    address = event.get("address")
                    if kind == wire.ErrorKind.MOVED and self.follow_redirects \
                            and isinstance(address, str):
                        self._subs.pop(sub.sub_id, None)
                        self._wire_last.pop(sub.sub_id, None)
                        sub.sub_id = None
                        async for moved in self._events_at(address, sub, reconnect_timeout_s):
                            yield moved
                        continue
                    raise SupervisorError(str(kind), str(event.get("message", "")))
                unowned_since = None
                yield event
        finally:
            if sub.sub_id is not None:
                self._subs.pop(sub.sub_id, None)
                self._wire_last.pop(sub.sub_id, None)
                with contextlib.suppress(SupervisorError):
                    await self.call("unsubscribe", timeout_s=1.0, sub=sub.sub_id)
