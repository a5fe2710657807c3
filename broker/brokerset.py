"""A client of several brokers (``python -m supervisor --broker A --broker B``).

``BrokerSet`` holds one ``BrokerClient`` per broker, all connected and
heartbeating at once, and sends each new call through one of them, the
*current* broker. It has the part of ``BrokerClient``'s API the supervisor
uses (``start``, ``request``, ``status``), so the engine does not know how
many brokers there are.

When a broker is lost:
- Lost means what it means for one ``BrokerClient``: no message from the
  broker for its liveness window (``heartbeat_interval_s`` x ``liveness``,
  checked every interval), or a heartbeat with a new broker id (a restart).
  That client then fails its own calls in flight as ``worker_lost``
  (retryable), as with a single broker; the other brokers' calls are not
  touched.
- Each new call goes to the current broker while it is heard within its
  window; otherwise to the first broker of the list that is, which becomes
  current (sticky: no return to the first broker while the one in use is
  heard, so calls do not flap). With none heard the current one keeps the
  call: it is sent when its broker is back, or failed at its deadline or by
  the loss, as with one broker.

Invariants: every call is one ``BrokerClient`` call, and keeps its
guarantees (ends exactly once, with a local deadline); a call never moves
between brokers (a failed one is re-sent by the engine, as a new call).
"""

from __future__ import annotations

import contextlib
import logging
from types import TracebackType
from typing import Any

from broker import protocol
from broker.client import BrokerClient, Call
from broker.security import CurveClient

log = logging.getLogger(__name__)

MAX_BROKERS = 8


class BrokerSet:
    """``async with BrokerSet([ep1, ep2], ...) as b: call = b.start(...)``."""

    def __init__(
        self, endpoints: list[str], *, heartbeat_interval_s: float = 0.25, liveness: int = 4,
        max_message_bytes: int = protocol.DEFAULT_MAX_MESSAGE_BYTES,
        identity: bytes | None = None, curve: CurveClient | None = None,
    ) -> None:
        endpoints = list(dict.fromkeys(endpoints))
        if not 1 <= len(endpoints) <= MAX_BROKERS:
            raise ValueError(f"give 1..{MAX_BROKERS} broker endpoints, got {len(endpoints)}")
        # One identity at every broker: each broker keeps its own client table, and a
        # restarted supervisor is recognised by each (see supervisor/main.py).
        self.clients = [
            BrokerClient(ep, heartbeat_interval_s=heartbeat_interval_s, liveness=liveness,
                         max_message_bytes=max_message_bytes, identity=identity,
                         curve=curve if ep.startswith("tcp://") else None)
            for ep in endpoints]
        self.endpoints = endpoints
        self.endpoint = endpoints[0]
        self.moves = 0  # how many times new calls moved to another broker
        self._current = 0
        self._stack: contextlib.AsyncExitStack | None = None

    async def __aenter__(self) -> BrokerSet:
        async with contextlib.AsyncExitStack() as stack:
            for client in self.clients:
                await stack.enter_async_context(client)
            self._stack = stack.pop_all()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    # ------------------------------------------------------------------ choosing

    @property
    def current(self) -> BrokerClient:
        """The broker new calls go to now (moves off a lost one; see the module doc)."""
        cur = self.clients[self._current]
        if cur.connected:
            return cur
        for i, client in enumerate(self.clients):
            if client.connected:
                log.warning("broker %s lost (silent past its window or restarted); new calls "
                            "go to %s", cur.endpoint, client.endpoint)
                self._current = i
                self.moves += 1
                return client
        return cur

    @property
    def broker_id(self) -> str | None:
        return self.current.broker_id

    @property
    def connected(self) -> bool:
        return any(client.connected for client in self.clients)

    # ------------------------------------------------------------------ BrokerClient's API

    def start(self, service: str, body: bytes, *, budget_s: float, attempt: int = 1) -> Call:
        return self.current.start(service, body, budget_s=budget_s, attempt=attempt)

    async def request(self, service: str, body: bytes, *, budget_s: float,
                      attempt: int = 1) -> bytes:
        return await self.current.request(service, body, budget_s=budget_s, attempt=attempt)

    async def status(self, *, timeout_s: float = 2.0) -> dict[str, Any]:
        """The current broker's STATUS, with ``brokers``: every broker of the set."""
        current = self.current
        data = await current.status(timeout_s=timeout_s)
        data["brokers"] = [
            {"endpoint": c.endpoint, "broker_id": c.broker_id, "connected": c.connected,
             "current": c is current} for c in self.clients]
        data["broker_moves"] = self.moves
        return data
