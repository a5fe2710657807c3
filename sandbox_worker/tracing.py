"""The worker's OpenTelemetry spans (``service.name`` = ``corral-worker``).

``install()`` (called by ``main`` when ``broker.otel.wanted()``) sets up the
process's tracer; ``wrap(service, handler)`` then gives each request a span
that continues the supervisor's trace from the payload's ``"trace"``
traceparent (``broker.otel.parse_traceparent``: a malformed one starts a new
trace, never an error):

    model request (server)      the whole request in this worker
    └── chat {model} (client)   the provider's HTTP request(s), with
                                ``gen_ai.server.time_to_first_token`` (the first
                                chunk relayed) and ``gen_ai.usage.*``
    tool request (server)
    ├── sandbox.launch          building and verifying the sandbox chain
    └── tool.run                the sandboxed process, spawn to exit

``span(name)`` is the in-code hook for the inner spans: a no-op
``nullcontext`` while tracing is off, so the tool path costs nothing then.

Invariants: requests carry a credential *name*; no key, prompt, argument or
output is put on a span here. A worker SIGKILLed mid-request loses its
unexported spans; the supervisor's client span still ends, with
``error.type`` = ``worker_lost``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from broker import otel
from broker.protocol import ProtocolError, unpack
from broker.worker import RequestContext

Handler = Callable[[RequestContext], Awaitable[bytes]]

_tracer: Any = None
_provider: Any = None


def install() -> None:
    global _tracer, _provider
    _provider = otel.configure("corral-worker")
    _tracer = _provider.get_tracer("corral.worker")


def shutdown() -> None:
    global _tracer, _provider
    if _provider is not None:
        otel.shutdown(_provider)  # bounded: a hung collector must not hold the stop
    _tracer = _provider = None


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[None]:
    """A child span of the current one while tracing is on; nothing otherwise."""
    if _tracer is None:
        yield
        return
    with _tracer.start_as_current_span(name, attributes=attributes):
        yield


def start(name: str, **attributes: Any) -> Any:
    """Start a child span of the current one (None while tracing is off); end it
    with ``end`` (for a region that is not one block)."""
    if _tracer is None:
        return None
    return _tracer.start_span(name, attributes=attributes)


def end(sp: Any, *, failed: bool = False) -> None:
    if sp is None:
        return
    if failed:
        from opentelemetry.trace import Status, StatusCode

        sp.set_status(Status(StatusCode.ERROR, "failed"))
    sp.end()


class _TimedContext(RequestContext):
    """The handler's context, noting when the first partial leaves."""

    def __init__(self, ctx: RequestContext, on_first: Callable[[], None]) -> None:
        super().__init__(ctx._job, ctx.request_id, ctx.service, ctx.attempt, ctx.body,
                         ctx.deadline)
        self._on_first: Callable[[], None] | None = on_first

    async def send_partial(self, body: bytes) -> None:
        if self._on_first is not None:
            first, self._on_first = self._on_first, None
            first()
        await super().send_partial(body)


def wrap(service: str, handler: Handler) -> Handler:
    if _tracer is None:
        return handler
    from opentelemetry.trace import SpanKind, Status, StatusCode

    async def traced(ctx: RequestContext) -> bytes:
        try:
            payload = unpack(ctx.body)
        except ProtocolError:
            payload = None
        payload = payload if isinstance(payload, dict) else {}
        parent = otel.remote_parent(payload.get("trace"))
        attrs: dict[str, Any] = {"corral.request.id": ctx.request_id,
                                 "corral.attempt": ctx.attempt}
        with _tracer.start_as_current_span(f"{service} request", context=parent,
                                           kind=SpanKind.SERVER, attributes=attrs) as server:
            if service != "model":
                tool = str(payload.get("tool"))
                server.set_attribute("gen_ai.tool.name", tool)
                server.set_attribute("gen_ai.tool.call.id", str(payload.get("call_id")))
                return await _run(handler, ctx, server, Status, StatusCode)
            raw = payload.get("route")
            route: dict[str, Any] = raw if isinstance(raw, dict) else {}
            with _tracer.start_as_current_span(
                    f"chat {route.get('model')}", kind=SpanKind.CLIENT, attributes={
                        "gen_ai.operation.name": "chat",
                        "gen_ai.system": str(route.get("provider")),
                        "gen_ai.request.model": str(route.get("model")),
                        "server.address": _host(route.get("base_url"))}) as chat:
                started = time.monotonic()

                def first() -> None:
                    chat.set_attribute("gen_ai.server.time_to_first_token",
                                       round(time.monotonic() - started, 6))
                    chat.add_event("first_token")

                body = await _run(handler, _TimedContext(ctx, first), chat, Status, StatusCode)
                with contextlib.suppress(ProtocolError):
                    reply = unpack(body)
                    usage = reply.get("usage") if isinstance(reply, dict) else None
                    if isinstance(usage, dict):
                        for key in ("input", "output"):
                            if isinstance(usage.get(key), int):
                                chat.set_attribute(f"gen_ai.usage.{key}_tokens", usage[key])
                return body

    return traced


async def _run(handler: Handler, ctx: RequestContext, sp: Any, status: Any,
               code: Any) -> bytes:
    try:
        return await handler(ctx)
    except BaseException as exc:
        kind = getattr(exc, "kind", None) or type(exc).__name__
        sp.set_attribute("error.type", str(kind))
        sp.set_status(status(code.ERROR, str(kind)))
        raise


def _host(url: object) -> str:
    from urllib.parse import urlsplit

    try:
        return urlsplit(str(url)).hostname or ""
    except ValueError:
        return ""
