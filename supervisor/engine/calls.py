"""Model and tool calls over the broker client: the one boundary where broker
errors become engine data.

``stream_call`` sends one REQUEST, hands every PARTIAL body (decoded) to a
callback in order, and returns the decoded REPLY. A broker FAILURE becomes
``CallFailure(kind, message, retryable)``; nothing from ``broker.errors`` or
msgpack leaks past this module.

Invariants:
- Cancellation (an interrupt, a shutdown) sends CANCEL through the broker and
  waits at most ``cancel_grace_s`` for that send, never for the worker: a hung
  or dead worker cannot delay an interrupt. ``CancelledError`` is re-raised.
- Every call carries a budget in seconds (``budget_s``); the broker fails it
  with ``timeout`` when the budget runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from broker.errors import BrokerError, RequestFailed
from broker.protocol import FailureKind, ProtocolError, pack, unpack

log = logging.getLogger(__name__)


class CallFailure(Exception):
    """A model or tool request that ended in a broker FAILURE, as data."""

    def __init__(self, kind: str, message: str, retryable: bool) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message
        self.retryable = retryable

    @property
    def worker_lost(self) -> bool:
        return self.kind == FailureKind.WORKER_LOST


class BrokerCall(Protocol):
    def __aiter__(self) -> Any: ...
    async def result(self) -> bytes: ...
    async def cancel(self) -> None: ...


class Broker(Protocol):
    """The part of ``broker.client.BrokerClient`` the engine uses."""

    def start(self, service: str, body: bytes, *, timeout_s: float,
              attempt: int = 1) -> Any: ...


async def stream_call(
    broker: Broker, service: str, payload: dict[str, Any], *, budget_s: float,
    attempt: int = 1, on_partial: Callable[[Any], Awaitable[None]] | None = None,
    cancel_grace_s: float = 0.3,
) -> Any:
    """Run one request to completion; return the decoded REPLY body."""
    try:
        call = broker.start(service, pack(payload), timeout_s=budget_s, attempt=attempt)
    except BrokerError as exc:
        raise CallFailure("broker_unavailable", str(exc), True) from exc
    try:
        async for body in call:
            if on_partial is not None:
                await on_partial(unpack(body))
        reply: bytes = await call.result()
        return unpack(reply)
    except RequestFailed as exc:
        raise CallFailure(exc.kind, exc.message, exc.retryable) from exc
    except BrokerError as exc:
        raise CallFailure("broker_unavailable", str(exc), True) from exc
    except ProtocolError as exc:
        raise CallFailure(FailureKind.PROTOCOL, f"undecodable {service} body: {exc}",
                          False) from exc
    except asyncio.CancelledError:
        # Bounded cleanup: tell the broker to cancel; never wait on the worker.
        await _send_cancel(call, cancel_grace_s)
        raise


async def _send_cancel(call: Any, grace_s: float) -> None:
    # A fresh task so that a pending cancellation of ours cannot abort the send;
    # waited on for at most grace_s, and always awaited/cancelled (no orphan).
    task = asyncio.ensure_future(call.cancel())
    try:
        await asyncio.wait({task}, timeout=grace_s)
    finally:
        if not task.done():
            task.cancel()
        with contextlib.suppress(BaseException):
            await task
