"""The supervisor's client endpoint: serves ``supervisor.wire`` calls on a
ZeroMQ ROUTER socket on top of a ``SessionManager``.

Invariants:
- One bad frame or call never affects other clients: every message is
  handled inside a catch-all at this boundary, answered with a typed error.
- Sends never block: ROUTER_MANDATORY with NOBLOCK; a client that cannot
  keep up (high-water mark reached) loses its subscription with
  ``slow_consumer`` and resubscribes from its last sequence.
- Every subscription and every running call is a task owned by this server's
  TaskGroup, both bounded in number per client; a client silent for ``client_liveness_s`` has all of
  its subscriptions cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import zmq

from broker.protocol import Failed
from broker.security import Guard, recv_frames_user, tenant_of_user_id
from broker.transport import readable, recv_frames, send_frames
from supervisor import wire
from supervisor.wire import ErrorKind

if TYPE_CHECKING:
    from supervisor.clienttools import ClientToolHost

log = logging.getLogger(__name__)

MAX_SUBSCRIPTIONS_PER_CLIENT = 256
MAX_CLIENTS = 10_000
MAX_CALLS_PER_CLIENT = 256  # calls of one client running at once
_DRAIN_BATCH = 256


class CallError(Failed):
    """A call failed in a way the client should see, with a kind."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message, kind=kind)


class Moved(CallError):
    """The session is owned by another supervisor of the farm: the answer names it."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(ErrorKind.MOVED, str(error["message"]))
        self.error = error


# Calls that need the session's owner (its live state); the others (history, export,
# list_sessions) read the shared store and are answered by any supervisor.
OWNER_CALLS = frozenset({"describe", "submit", "subscribe", "delete_session",
                         "register_client"})


class Backend(Protocol):
    """What the server needs from the supervisor (a facade over the engine)."""

    async def create_session(self, spec: dict[str, Any], tenant: str | None) -> str: ...
    async def submit(self, session_id: str, op: dict[str, Any], tenant: str | None) -> str: ...
    def subscribe(self, session_id: str, after_sequence: int,
                  tenant: str | None) -> Any: ...  # AsyncIterator[dict]
    async def list_sessions(self, args: dict[str, Any], tenant: str | None) -> Any: ...
    async def describe(self, session_id: str, tenant: str | None) -> Any: ...
    async def delete_session(self, session_id: str, tenant: str | None) -> Any: ...
    async def history(self, session_id: str, after_sequence: int, limit: int,
                      tenant: str | None) -> Any: ...
    async def status(self) -> Any: ...
    async def export(self, session_id: str, tenant: str | None) -> Any: ...


@dataclasses.dataclass
class _Client:
    identity: bytes
    tenant: str | None
    last_seen: float
    calls_running: int = 0
    liveness_s: float | None = None  # asked for by the client (register_client)
    subs: dict[int, asyncio.Task[None]] = dataclasses.field(default_factory=dict)


class ClientServer:
    def __init__(
        self,
        backend: Backend,
        endpoint: str,
        *,
        heartbeat_interval_s: float = 0.5,
        client_liveness_s: float = 10.0,
        tenant_of: Callable[[bytes], str | None] | None = None,
        configure_socket: Callable[[zmq.Socket[Any]], None] | None = None,
        guard: Guard | None = None,
        client_host: ClientToolHost | None = None,
        locate: Callable[[str, str | None], Awaitable[tuple[str, str] | None]] | None = None,
        place: Callable[[], Awaitable[tuple[str, str] | None]] | None = None,
    ) -> None:
        self.backend = backend
        # Several supervisors on one store: (owner, address) of a session another
        # supervisor owns, for a redirect (supervisor.leasing.redirect).
        self._locate = locate
        # ... and where a new session goes: the least loaded supervisor (leasing.place).
        self._place = place
        # Client tools and hooks (supervisor/clienttools.py) answer over this endpoint.
        self.client_host = client_host
        if client_host is not None:
            client_host.attach(self._send)
        self.endpoint = endpoint
        self.bound_endpoint: str | None = None
        self.instance_id = uuid.uuid4().hex
        self.heartbeat_interval_s = heartbeat_interval_s
        self.client_liveness_s = client_liveness_s
        self._tenant_of = tenant_of
        self._configure_socket = configure_socket
        # CURVE + ZAP on a tcp:// endpoint; each message's tenant then comes from
        # the ZAP User-Id of its connection (broker/security.py), never from the
        # client-chosen routing identity.
        self._guard = guard
        self._clients: dict[bytes, _Client] = {}
        self._sock: zmq.Socket[bytes] | None = None
        self._readable = asyncio.Event()
        self._tg: asyncio.TaskGroup | None = None
        self.counters: dict[str, int] = {"calls": 0, "bad_frames": 0, "errors": 0,
                                         "slow_consumers": 0, "expired_clients": 0}

    def bind(self) -> str:
        # A plain socket driven from the loop by its fd, like broker.transport:
        # the fd is edge-triggered, so EVENTS is re-read after every send and
        # before every wait (a send can consume the edge of an arriving message).
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.SNDHWM, 20_000)
        sock.setsockopt(zmq.RCVHWM, 20_000)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES + 1024)
        if self._configure_socket is not None:
            self._configure_socket(sock)
        if self._guard is not None and self.endpoint.startswith("tcp://"):
            self._guard.secure(sock, "clients")
        sock.bind(self.endpoint)
        self._sock = sock
        self.bound_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.bound_endpoint

    async def run(self) -> None:
        if self._sock is None:
            self.bind()
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        fd: int = self._sock.getsockopt(zmq.FD)  # type: ignore[assignment]
        loop.add_reader(fd, self._readable.set)
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                tg.create_task(self._heartbeat_loop())
                if self._guard is not None:
                    tg.create_task(self._guard.run())
                await self._read_loop()
        finally:
            loop.remove_reader(fd)
            self._sock.close(linger=0)

    # -- sending ----------------------------------------------------------

    def _send(self, identity: bytes, msg: dict[str, Any]) -> bool:
        """Send without blocking; False when the client is gone or saturated."""
        sock = self._sock
        if sock is None:
            return False
        # Every message names the server instance, so a client notices a restart
        # from the first message of the new instance, even one it never heard.
        msg["srv"] = self.instance_id
        try:
            send_frames(sock, [identity, *wire.encode(msg)])
            return True
        except zmq.ZMQError as exc:  # EAGAIN (pipe full) or EHOSTUNREACH (gone)
            self.counters["send_failures"] = self.counters.get("send_failures", 0) + 1
            log.debug("send to client %s failed: %s", identity.hex()[:16], exc)
            return False
        finally:
            if readable(sock):
                self._readable.set()

    # -- loops ------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            now = time.monotonic()
            for client in list(self._clients.values()):
                if now - client.last_seen > (client.liveness_s or self.client_liveness_s):
                    self._drop_client(client, "silent")
                else:
                    self._send(client.identity, {"hb": True})

    def _drop_client(self, client: _Client, why: str, *, notify: bool = True) -> None:
        log.info("client %s %s; cancelling %d subscription(s)", client.identity.hex(), why,
                 len(client.subs))
        self.counters["expired_clients"] += 1
        # Best effort: a client that was only slow (paused, starved) reads this
        # later and resubscribes (and holds its client tools again).
        if notify:  # never to the principal that took a routing identity over
            self._send(client.identity, {"dropped": {"why": why}})
        for task in client.subs.values():
            task.cancel()
        self._clients.pop(client.identity, None)
        if self.client_host is not None:
            self.client_host.client_gone(client.identity)

    async def _read_loop(self) -> None:
        assert self._sock is not None
        sock = self._sock
        while True:
            for _ in range(_DRAIN_BATCH):
                try:
                    if self._guard is None:
                        frames, user = recv_frames(sock), None
                    else:
                        frames, user = recv_frames_user(sock)
                except zmq.Again:
                    break
                await self._on_frames(frames, user)
            else:
                await asyncio.sleep(0)  # a full batch: let the other tasks run
                continue
            self._readable.clear()
            if readable(sock):
                continue
            await self._readable.wait()

    async def _on_frames(self, frames: list[bytes], user: bytes | None = None) -> None:
        if len(frames) < 2:
            self.counters["bad_frames"] += 1
            return
        identity, rest = frames[0], frames[1:]
        client = self._clients.get(identity)
        tenant = tenant_of_user_id(user) if user is not None else None
        if user is not None and client is not None and client.tenant != tenant:
            # Another principal took this routing identity over (ROUTER_HANDOVER):
            # nothing of the old client's carries over to it.
            log.warning("refused: identity %s reused by tenant %r (was %r); "
                        "dropping the old client's state", identity.hex()[:16], tenant,
                        client.tenant)
            self._drop_client(client, "taken over by another key", notify=False)
            # Calls of the old client still running answer to no one (an empty
            # routing id is unroutable), never to the new principal.
            client.identity = b""
            client = None
        if client is None:
            if len(self._clients) >= MAX_CLIENTS:
                self.counters["bad_frames"] += 1
                return
            if user is None and self._tenant_of is not None:
                tenant = self._tenant_of(identity)
            client = _Client(identity, tenant, time.monotonic())
            self._clients[identity] = client
        client.last_seen = time.monotonic()
        try:
            msg = wire.decode(rest)
        except wire.WireError as exc:
            self.counters["bad_frames"] += 1
            log.warning("bad frame from client %s: %s", identity.hex()[:16], exc)
            return
        try:
            call_id, call, args = wire.parse_call(msg)
        except wire.WireError as exc:
            self.counters["bad_frames"] += 1
            raw_id = msg.get("id")
            if isinstance(raw_id, int) and not isinstance(raw_id, bool):
                self._answer_error(identity, raw_id, ErrorKind.BAD_REQUEST, str(exc))
            return
        self.counters["calls"] += 1
        if call == "ping":
            if call_id:
                self._send(identity, {"id": call_id, "ok": True, "result": "pong"})
            return
        assert self._tg is not None
        # Calls run as tasks so a slow call never stalls the read loop.
        if client.calls_running >= MAX_CALLS_PER_CLIENT:
            self._answer_error(identity, call_id, ErrorKind.BAD_REQUEST,
                               f"more than {MAX_CALLS_PER_CLIENT} calls in flight; wait for "
                               "answers before sending more")
            return
        client.calls_running += 1
        self._tg.create_task(self._run_call(client, call_id, call, args))

    def _answer_error(self, identity: bytes, call_id: int, kind: str, message: str) -> None:
        self._send(identity, {"id": call_id, "ok": False,
                              "error": {"kind": kind, "message": message}})

    async def _run_call(self, client: _Client, call_id: int, call: str,
                        args: dict[str, Any]) -> None:
        try:
            await self._run_call_inner(client, call_id, call, args)
        finally:
            client.calls_running -= 1

    async def _run_call_inner(self, client: _Client, call_id: int, call: str,
                              args: dict[str, Any]) -> None:
        try:
            result = await self._dispatch(client, call, args)
        except asyncio.CancelledError:
            raise
        except Moved as exc:
            self._send(client.identity, {"id": call_id, "ok": False, "error": exc.error})
            return
        except CallError as exc:
            moved = await self._moved(exc.kind, args.get("session_id"), client.tenant)
            if moved is not None:
                self._send(client.identity, {"id": call_id, "ok": False, "error": moved})
                return
            self._answer_error(client.identity, call_id, exc.kind, exc.message)
            return
        except Failed as exc:  # engine, store, export and broker failures: data already
            self.counters["errors"] += 1
            self._answer_error(client.identity, call_id, exc.kind, exc.message)
            return
        except Exception:  # message boundary: one bad call never kills the server
            self.counters["errors"] += 1
            log.exception("call %s failed", call)
            self._answer_error(client.identity, call_id, ErrorKind.INTERNAL,
                               "internal error in the supervisor; see its log")
            return
        self._send(client.identity, {"id": call_id, "ok": True, "result": result})

    @staticmethod
    def _arg(args: dict[str, Any], name: str, typ: type, default: Any = ...) -> Any:
        value = args.get(name, default)
        if value is ... or not isinstance(value, typ) or (isinstance(value, bool) and typ is int):
            raise CallError(ErrorKind.BAD_REQUEST, f"argument {name!r} must be a {typ.__name__}")
        return value

    async def _dispatch(self, client: _Client, call: str, args: dict[str, Any]) -> Any:
        b, tenant = self.backend, client.tenant
        if call in OWNER_CALLS:
            moved = await self._moved(ErrorKind.UNKNOWN_SESSION, args.get("session_id"),
                                      tenant)
            if moved is not None:
                raise Moved(moved)
        if call == "hello":
            return {"instance_id": self.instance_id, "tenant": tenant}
        if call == "create_session":
            spec = self._arg(args, "spec", dict)
            # "placed": the client followed a placement already; never bounce it again.
            if self._place is not None and args.get("placed") is not True:
                target = await self._place()
                if target is not None:
                    raise Moved({"kind": ErrorKind.MOVED, "owner": target[0],
                                 "address": target[1], "message": "new sessions go to the "
                                 f"least loaded supervisor, {target[0]}: ask it at "
                                 f"{target[1]}"})
            return await b.create_session(spec, tenant)
        if call == "submit":
            return await b.submit(self._arg(args, "session_id", str),
                                  self._arg(args, "op", dict), tenant)
        if call == "subscribe":
            return self._subscribe(client, self._arg(args, "session_id", str),
                                   self._arg(args, "after_sequence", int, 0),
                                   self._arg(args, "sub", int))
        if call == "unsubscribe":
            task = client.subs.pop(self._arg(args, "sub", int), None)
            if task is not None:
                task.cancel()
            return True
        if call == "list_sessions":
            return await b.list_sessions(args, tenant)
        if call == "describe":
            return await b.describe(self._arg(args, "session_id", str), tenant)
        if call == "delete_session":
            return await b.delete_session(self._arg(args, "session_id", str), tenant)
        if call == "history":
            return await b.history(self._arg(args, "session_id", str),
                                   self._arg(args, "after_sequence", int, 0),
                                   min(self._arg(args, "limit", int, 500), 5000), tenant)
        if call == "export":
            return await b.export(self._arg(args, "session_id", str), tenant)
        if call in ("register_client", "client_result"):
            return await self._client_tools(client, call, args)
        if call == "status":
            status = await b.status()
            status["client_endpoint"] = {"clients": len(self._clients), **self.counters}
            return status
        raise CallError(ErrorKind.BAD_REQUEST, f"unknown call {call!r}")  # pragma: no cover

    async def _client_tools(self, client: _Client, call: str, args: dict[str, Any]) -> Any:
        """``register_client``: hold a session's client tools and hooks (and ask
        for a liveness window); ``client_result``: answer a pushed call."""
        host = self.client_host
        if host is None:
            raise CallError(ErrorKind.BAD_REQUEST, "this supervisor has no client tools")
        if call == "client_result":
            return host.resolve(client.identity, self._arg(args, "id", int),
                                args.get("result"))
        liveness = args.get("liveness_s")
        if liveness is not None:
            if isinstance(liveness, bool) or not isinstance(liveness, int | float) \
                    or not 1.0 <= liveness <= self.client_liveness_s:
                raise CallError(ErrorKind.BAD_REQUEST, "liveness_s must be in [1, "
                                f"{self.client_liveness_s:g}] seconds")
            client.liveness_s = float(liveness)
        tools = self._arg(args, "tools", list, [])
        if not all(isinstance(t, str) for t in tools):
            raise CallError(ErrorKind.BAD_REQUEST, "tools must be a list of names")
        return await host.register(client.identity, client.tenant,
                                   self._arg(args, "session_id", str), tools,
                                   bool(args.get("hooks", False)))

    def _subscribe(self, client: _Client, session_id: str, after_sequence: int,
                   sub_id: int) -> int:
        """Start pushing events under the client's own subscription id (chosen by
        the client, so it can route events that overtake this call's answer)."""
        if len(client.subs) >= MAX_SUBSCRIPTIONS_PER_CLIENT:
            raise CallError(ErrorKind.BAD_REQUEST,
                            f"at most {MAX_SUBSCRIPTIONS_PER_CLIENT} subscriptions per client")
        if sub_id in client.subs or not 0 < sub_id < 2**62:
            raise CallError(ErrorKind.BAD_REQUEST, f"subscription id {sub_id} is in use or "
                            "out of range")
        iterator = self.backend.subscribe(session_id, after_sequence, client.tenant)
        assert self._tg is not None
        client.subs[sub_id] = self._tg.create_task(self._pump(client, sub_id, iterator,
                                                              session_id))
        return sub_id

    async def _moved(self, kind: str, session_id: Any,
                     tenant: str | None) -> dict[str, Any] | None:
        """The ``moved`` error that replaces ``unknown_session`` (or comes before an
        owner call) when another supervisor of the farm owns the session and the
        caller's tenant may see it: its owner and client address, for the client to
        ask there (docs/multihost.md)."""
        if kind != ErrorKind.UNKNOWN_SESSION or self._locate is None \
                or not isinstance(session_id, str):
            return None
        found = await self._locate(session_id, tenant)
        if found is None:
            return None
        owner, address = found
        return {"kind": ErrorKind.MOVED, "address": address, "owner": owner,
                "message": f"session {session_id} is owned by supervisor {owner}; "
                           f"ask it at {address}"}

    async def _pump(self, client: _Client, sub_id: int, iterator: Any,
                    session_id: str) -> None:
        end: dict[str, Any] | None = None
        try:
            async for event in iterator:
                if not self._send(client.identity, {"sub": sub_id, "event": event}):
                    self.counters["slow_consumers"] += 1
                    end = {"kind": ErrorKind.SLOW_CONSUMER,
                           "message": "client could not keep up; resubscribe from the last "
                                      "sequence you saw"}
                    return
            # Ended because the session left this supervisor (its lease was lost and it
            # was given up): the new owner, if one holds it yet, is where to go.
            end = await self._moved(ErrorKind.UNKNOWN_SESSION, session_id, client.tenant) \
                or {"kind": "closed", "message": "session closed"}
        except asyncio.CancelledError:
            raise
        except Failed as exc:  # boundary: report to this subscriber only
            end = await self._moved(exc.kind, session_id, client.tenant) or {
                "kind": exc.kind, "message": exc.message}
        except Exception:  # boundary: report to this subscriber only
            log.exception("subscription %s failed", sub_id)
            end = {"kind": ErrorKind.INTERNAL,
                   "message": "internal error in the supervisor; see its log"}
        finally:
            client.subs.pop(sub_id, None)
            with contextlib.suppress(Exception):
                aclose = getattr(iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
            if end is not None:
                self._send(client.identity, {"sub": sub_id, "end": end})
