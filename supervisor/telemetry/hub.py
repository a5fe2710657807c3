"""``Telemetry``: the one observer the supervisor hands to the engine.

The manager calls ``committed(step, seconds)`` after each store commit;
``calls.stream_call`` calls ``begin(service, payload)`` for each request. The
hub fans both out to the metrics (``metrics.FarmMetrics``, when on), the
tracer (``tracing.Tracer``, when on) and the web view's live feed (``web``,
when on). Each sink is called inside a catch-all: an observer's bug is logged
once per kind and never reaches the turn that triggered it.

Invariants:
- Nothing here blocks: every sink's work is in-memory bookkeeping (the OTLP
  exporter and the HTTP servers run in their own threads).
- A watch is ended exactly once (``end``), whatever the call's outcome.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from broker.protocol import Failure
from supervisor.engine.calls import CallWatch
from supervisor.store.records import EventRecord, StepWrite

log = logging.getLogger(__name__)


class CallSink(Protocol):
    """A sink's part of one request (the tracer's span)."""

    trace: str | None

    def first_partial(self, ttft_s: float) -> None: ...

    def end(self, reply: Any, failure: Failure | None, duration_s: float) -> None: ...


class Sink(Protocol):
    def committed(self, events: list[EventRecord], seconds: float) -> None: ...

    def begin(self, service: str, payload: dict[str, Any]) -> CallSink | None: ...


class Telemetry:
    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks
        self._warned: set[str] = set()

    def guard(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception:  # an observer's bug must never reach the turn
            if what not in self._warned:
                self._warned.add(what)
                log.exception("telemetry: %s failed (said once)", what)
            return None

    def committed(self, step: StepWrite, seconds: float) -> None:
        for sink in self.sinks:
            self.guard(f"{type(sink).__name__}.committed",
                       partial(sink.committed, step.events, seconds))

    def begin(self, service: str, payload: dict[str, Any]) -> CallWatch:
        parts: list[CallSink] = []
        for sink in self.sinks:
            part = self.guard(f"{type(sink).__name__}.begin",
                              partial(sink.begin, service, payload))
            if part is not None:
                parts.append(part)
        return _Watch(self, parts)


class _Watch:
    def __init__(self, hub: Telemetry, parts: list[CallSink]) -> None:
        self.hub = hub
        self.parts = parts
        self.started = time.monotonic()
        self.trace: str | None = next((p.trace for p in parts if p.trace), None)
        self._ended = False

    def first_partial(self) -> None:
        ttft = time.monotonic() - self.started
        for part in self.parts:
            self.hub.guard("first_partial", partial(part.first_partial, ttft))

    def end(self, reply: Any, failure: Failure | None) -> None:
        if self._ended:
            return
        self._ended = True
        duration = time.monotonic() - self.started
        for part in self.parts:
            self.hub.guard("end", partial(part.end, reply, failure, duration))
