"""OpenTelemetry set-up shared by the farm's processes (supervisor, worker).

``wanted(endpoint)`` says whether traces are on: an OTLP endpoint is set by the
standard variables (``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) or by corral.toml's ``[telemetry]
otlp_endpoint``; ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``
turn them off. ``configure(service_name)`` builds the process's
``TracerProvider`` with a batching OTLP HTTP/protobuf exporter (every other
``OTEL_*`` variable, e.g. ``OTEL_EXPORTER_OTLP_HEADERS`` or
``OTEL_BSP_SCHEDULE_DELAY``, is read by the SDK itself).

Trace context crosses processes as one W3C ``traceparent`` string
(``00-<32 hex>-<16 hex>-<2 hex>``) in the request payload's ``"trace"`` key;
``parse_traceparent`` accepts only that shape (55 characters), so a peer can
never make us carry anything else or anything bigger.

The broker reads that key from the payload's last bytes only
(``traceparent_at_end``): it never decodes a payload. It is a hop of the
trace: it rewrites those 55 bytes in the REQUEST it forwards so that they name
its own span (``with_parent``: same trace id and flags, same length, so the
payload stays the same valid msgpack and a worker of any version reads it as
before). A tail that is not a well-formed traceparent is left untouched.

A collector that is down or hangs costs no turn any time: the SDK exports in
its own thread (each export bounded by ``OTEL_EXPORTER_OTLP_TIMEOUT``, 10 s)
and keeps at most ``OTEL_BSP_MAX_QUEUE_SIZE`` spans (2048), dropping the
oldest past that; ``dropped_spans()`` counts those drops
(``corral_trace_spans_dropped_total`` in the supervisor's metrics). A
stopping process gives its last spans ``SHUTDOWN_S`` (``shutdown``), never
the SDK's own wait, which a hung collector stretches past the stop grace.

Invariants: nothing here is imported by a process whose traces are off
(the ``opentelemetry`` imports are inside the functions); the exporter runs in
the SDK's own thread and never blocks the event loop.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from typing import Any

TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
MAX_TRACEPARENT = 55


def wanted(endpoint: str | None = None) -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or endpoint)


SHUTDOWN_S = 2.0  # what a stopping process gives its last spans (its stop grace is 5-10 s)
_dropped = 0
_dropped_lock = threading.Lock()
log = logging.getLogger(__name__)


def shutdown(provider: Any, deadline_s: float = SHUTDOWN_S) -> bool:
    """Flush and stop ``provider`` within ``deadline_s``; False when the collector
    did not take the last spans in time (they are lost; the process goes on
    stopping: the SDK's own wait, up to 30 s per export, would outlast the
    process's stop grace and get it SIGKILLed)."""
    done = threading.Thread(target=provider.shutdown, name="otel-shutdown", daemon=True)
    done.start()
    done.join(deadline_s)
    if done.is_alive():
        log.warning("traces: the collector did not take the last spans within %.1fs; "
                    "stopping without them", deadline_s)
        return False
    return True


def dropped_spans() -> int:
    """Spans this process's exporter queue dropped (a collector down or slow)."""
    return _dropped


def _processor(exporter: Any) -> Any:
    """The SDK's ``BatchSpanProcessor``, counting the spans it drops (its queue
    full: it then drops the oldest; the SDK logs that once per 20 s)."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    class Counting(BatchSpanProcessor):
        def on_end(self, span: Any) -> None:
            batch = getattr(self, "_batch_processor", None)
            queue = getattr(batch, "_queue", None)
            if (queue is not None and span.context.trace_flags.sampled
                    and len(queue) >= getattr(batch, "_max_queue_size", 0) > 0):
                global _dropped
                with _dropped_lock:
                    _dropped += 1
            super().on_end(span)

    return Counting(exporter)


def configure(service_name: str, endpoint: str | None = None, id_generator: Any = None) -> Any:
    """The process's ``TracerProvider`` exporting to the OTLP endpoint."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    if endpoint and not (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                         or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
    resource = Resource.create({"service.name": service_name,
                                "service.namespace": "corral"})
    # No atexit shutdown: it would wait for a hung collector again at exit.
    provider = TracerProvider(resource=resource, id_generator=id_generator,
                              shutdown_on_exit=False)
    provider.add_span_processor(_processor(OTLPSpanExporter()))
    return provider


def parse_traceparent(value: object) -> tuple[int, int, int] | None:
    """``(trace_id, span_id, flags)`` of a well-formed traceparent, else None."""
    if not isinstance(value, str) or len(value) != MAX_TRACEPARENT:
        return None
    m = TRACEPARENT.fullmatch(value)
    if m is None:
        return None
    trace_id, span_id = int(m.group(1), 16), int(m.group(2), 16)
    if trace_id == 0 or span_id == 0:
        return None
    return trace_id, span_id, int(m.group(3), 16)


_TAIL_KEY = b"\xa5trace\xd9\x37"  # msgpack: fixstr "trace", then str8 of 55 bytes
_TAIL = len(_TAIL_KEY) + MAX_TRACEPARENT


def traceparent_at_end(body: bytes) -> str | None:
    """The traceparent of a request payload whose last key is ``"trace"`` (as
    ``calls.stream_call`` adds it), read from the body's last 63 bytes without
    decoding the rest (the broker's hot path); None otherwise."""
    if len(body) < _TAIL or body[-_TAIL:-MAX_TRACEPARENT] != _TAIL_KEY:
        return None
    try:
        value = body[-MAX_TRACEPARENT:].decode("ascii")
    except UnicodeDecodeError:
        return None
    return value if parse_traceparent(value) is not None else None


def with_parent(body: bytes, span_id: int) -> bytes:
    """``body`` whose trailing traceparent names ``span_id`` as the parent
    (trace id and flags kept); ``body`` itself when it has no well-formed one
    or ``span_id`` is not a valid span id."""
    value = traceparent_at_end(body)
    if value is None or not 0 < span_id < 1 << 64:
        return body
    parent = f"{value[:36]}{span_id:016x}{value[52:]}".encode("ascii")
    return body[:-MAX_TRACEPARENT] + parent


def format_traceparent(trace_id: int, span_id: int, sampled: bool = True) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"


def remote_parent(value: object) -> Any:
    """An OpenTelemetry ``Context`` whose parent is the traceparent's span, or None."""
    parsed = parse_traceparent(value)
    if parsed is None:
        return None
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    trace_id, span_id, flags = parsed
    ctx = SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags))
    return trace.set_span_in_context(NonRecordingSpan(ctx))
