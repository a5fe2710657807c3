"""Model and tool calls over the broker client: the one boundary where broker
errors become engine data.

``stream_call`` sends one REQUEST, hands every PARTIAL body (decoded) to a
callback in order, and returns the decoded REPLY. A broker FAILURE becomes
``errors.CallFailed`` (a ``broker.protocol.Failed``: kind, message,
retryable); nothing from ``broker.errors`` or msgpack leaks past this module.

Invariants:
- Cancellation (an interrupt, a shutdown) sends CANCEL through the broker and
  waits at most ``cancel_grace_s`` for that send, never for the worker: a hung
  or dead worker cannot delay an interrupt. ``CancelledError`` is re-raised.
- Every call carries a budget in seconds (``budget_s``); the broker fails it
  with ``timeout`` when the budget runs out.
- Telemetry observes here and only here (``set_call_observer``): one
  ``CallWatch`` per request sees its first partial and its end; when it gives
  a ``trace`` (a W3C traceparent) the payload carries it as ``"trace"``, a key
  workers that do not trace ignore. A watch never changes a call's outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from broker.errors import BrokerError, RequestFailed
from broker.protocol import Failure, FailureKind, ProtocolError, pack, unpack
from sandbox_worker.api import (
    IMAGE_DIGEST_RE,
    SERVICE_MODEL,
    SERVICE_TOOL,
    MalformedResult,
    ModelCallResult,
    ToolCallRequest,
    ToolCallResult,
    decode_model_result,
    decode_tool_result,
    image_service,
)
from supervisor.engine.errors import CallFailed
from supervisor.engine.routers import find_router
from supervisor.tools.router import router_for

log = logging.getLogger(__name__)


class Broker(Protocol):
    """The part of ``broker.client.BrokerClient`` the engine uses."""

    def start(self, service: str, body: bytes, *, budget_s: float,
              attempt: int = 1) -> Any: ...


class CallWatch(Protocol):
    """Telemetry's view of one request (``supervisor.telemetry``)."""

    trace: str | None  # a W3C traceparent for the payload, or None

    def first_partial(self) -> None: ...

    def end(self, reply: Any, failure: Failure | None) -> None: ...


class CallObserver(Protocol):
    def begin(self, service: str, payload: dict[str, Any]) -> CallWatch: ...


_observer: CallObserver | None = None


def set_call_observer(observer: CallObserver | None) -> None:
    """Install (or remove, with None) the process's one call observer."""
    global _observer
    _observer = observer


async def stream_call(
    broker: Broker, service: str, payload: dict[str, Any], *, budget_s: float,
    attempt: int = 1, on_partial: Callable[[Any], Awaitable[None]] | None = None,
    cancel_grace_s: float = 0.3,
) -> Any:
    """Run one request to completion; return the decoded REPLY body."""
    watch = _observer.begin(service, payload) if _observer is not None else None
    if watch is None:
        return await _stream_call(broker, service, payload, budget_s=budget_s,
                                  attempt=attempt, on_partial=on_partial,
                                  cancel_grace_s=cancel_grace_s)
    if watch.trace:
        payload = {**payload, "trace": watch.trace}
    first = True

    async def partial(body: Any) -> None:
        nonlocal first
        if first:
            first = False
            watch.first_partial()
        if on_partial is not None:
            await on_partial(body)

    try:
        reply = await _stream_call(broker, service, payload, budget_s=budget_s,
                                   attempt=attempt, on_partial=partial,
                                   cancel_grace_s=cancel_grace_s)
    except CallFailed as exc:
        watch.end(None, exc.failure)
        raise
    except asyncio.CancelledError:
        watch.end(None, Failure(FailureKind.CANCELLED, "cancelled", False))
        raise
    watch.end(reply, None)
    return reply


async def _stream_call(
    broker: Broker, service: str, payload: dict[str, Any], *, budget_s: float,
    attempt: int, on_partial: Callable[[Any], Awaitable[None]] | None,
    cancel_grace_s: float,
) -> Any:
    try:
        call = broker.start(service, pack(payload), budget_s=budget_s, attempt=attempt)
    except BrokerError as exc:
        raise CallFailed("broker_unavailable", str(exc), True) from exc
    try:
        async for body in call:
            if on_partial is not None:
                await on_partial(unpack(body))
        reply: bytes = await call.result()
        return unpack(reply)
    except RequestFailed as exc:
        raise CallFailed(exc.kind, exc.message, exc.retryable) from exc
    except BrokerError as exc:
        raise CallFailed("broker_unavailable", str(exc), True) from exc
    except ProtocolError as exc:
        raise CallFailed(FailureKind.PROTOCOL, f"undecodable {service} body: {exc}",
                         False) from exc
    except asyncio.CancelledError:
        # Bounded cleanup: tell the broker to cancel; never wait on the worker.
        await _send_cancel(call, cancel_grace_s)
        raise


async def call_model(
    broker: Broker, payload: dict[str, Any], *, budget_s: float, attempt: int = 1,
    on_partial: Callable[[Any], Awaitable[None]] | None = None, cancel_grace_s: float = 0.3,
) -> ModelCallResult:
    """One ``model`` request; its REPLY decoded and checked once (``CallFailed``
    with kind ``protocol`` when malformed)."""
    body = await stream_call(broker, SERVICE_MODEL, payload, budget_s=budget_s,
                             attempt=attempt, on_partial=on_partial,
                             cancel_grace_s=cancel_grace_s)
    try:
        return decode_model_result(body)
    except MalformedResult as exc:
        raise CallFailed(FailureKind.PROTOCOL, str(exc), False) from None


def tool_sender(
    broker: Broker, *, budget_s: float, attempt: int = 1,
    on_partial: Callable[[Any], Awaitable[None]] | None = None, cancel_grace_s: float = 0.3,
) -> Callable[[str, dict[str, Any]], Awaitable[ToolCallResult]]:
    """A function sending one tool payload to a service (``tool`` or a pinned
    ``tool@PIN``) and returning its decoded, checked REPLY."""

    async def send(service: str, payload: dict[str, Any]) -> ToolCallResult:
        body = await stream_call(broker, service, payload, budget_s=budget_s,
                                 attempt=attempt, on_partial=on_partial,
                                 cancel_grace_s=cancel_grace_s)
        try:
            return decode_tool_result(body)
        except MalformedResult as exc:
            raise CallFailed(FailureKind.PROTOCOL, str(exc), False) from None

    return send


async def call_tool(
    broker: Broker, request: ToolCallRequest, *, budget_s: float, attempt: int = 1,
    on_partial: Callable[[Any], Awaitable[None]] | None = None, cancel_grace_s: float = 0.3,
) -> ToolCallResult:
    """One ``tool`` request; its REPLY decoded and checked once (``CallFailed``
    with kind ``protocol`` when malformed). A command tool's or MCP server's
    call (``command_tool`` / ``mcp``, attached by ``tooling.outside_request``)
    goes through the outside-tool router: validated against its schema here,
    and an MCP call sent to the worker that holds its server. A name another
    router takes (client tools: ``engine/routers.py``) runs there instead of
    through the broker."""
    send = image_routed(tool_sender(broker, budget_s=budget_s, attempt=attempt,
                                    on_partial=on_partial, cancel_grace_s=cancel_grace_s),
                        request)
    if "command_tool" in request or "mcp" in request:
        return await router_for(broker).call(send, request)
    router = await find_router(request)
    if router is not None:
        return await router.call(request, budget_s=budget_s, on_partial=on_partial)
    return await send(SERVICE_TOOL, dict(request))


def image_routed(send: Callable[[str, dict[str, Any]], Awaitable[ToolCallResult]],
                 request: ToolCallRequest,
                 ) -> Callable[[str, dict[str, Any]], Awaitable[ToolCallResult]]:
    """``send`` for a session in an image (docs/images.md): what would go to
    ``tool`` goes first to ``tool@img-HEX``, served by the workers that hold the
    image; the broker fails that at once with ``unroutable`` (never queued, never
    dispatched) when none does, and the call then goes to ``tool``, whose worker
    fetches the image or fails the call with a typed error. Pinned services
    (MCP affinity) are left alone."""
    digest = (request.get("policy") or {}).get("image")
    if not isinstance(digest, str) or not IMAGE_DIGEST_RE.fullmatch(digest):
        return send

    async def routed(service: str, payload: dict[str, Any]) -> ToolCallResult:
        if service != SERVICE_TOOL:
            return await send(service, payload)
        try:
            return await send(image_service(digest), payload)
        except CallFailed as f:
            if f.kind != FailureKind.UNROUTABLE:
                raise
        return await send(SERVICE_TOOL, payload)

    return routed


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
