"""Switching the supervisor's telemetry on: ``started(...)``, one context manager.

It builds the sinks asked for (metrics when a metrics address is given,
traces when an OTLP endpoint is configured, the web view's feed when a web
address is given), installs the hub on the manager and on
``calls.set_call_observer``, starts the HTTP servers (each in its own daemon
thread), yields what was bound (for the ready line), and on exit uninstalls
the hub, stops the servers and flushes the exporter.

Invariants:
- With nothing asked for, nothing is imported or installed (zero cost).
- Addresses are ``HOST:PORT`` (``[v6]:PORT`` too); port 0 binds any free
  port and the ready line says which.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from supervisor.engine import calls, hooks
from supervisor.engine.manager import SessionManager

log = logging.getLogger(__name__)
T = TypeVar("T")


def split_host_port(text: str) -> tuple[str, int]:
    """``"127.0.0.1:9464"`` / ``"[::1]:0"`` -> (host, port); ValueError if not."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"not HOST:PORT: {text!r}")
    return host.strip("[]"), int(port)


def tracing_wanted(otlp_endpoint: str | None) -> bool:
    """Traces are on when an OTLP endpoint is set (``broker.otel.wanted``)."""
    from broker import otel

    return otel.wanted(otlp_endpoint)


@dataclass
class Wanted:
    metrics_listen: str | None = None
    web_listen: str | None = None
    tracing: bool = False
    otlp_endpoint: str | None = None
    record_content: bool = False
    # A restart's ports (the farm pins HOST:0 to the port the first start bound): when
    # another process took one meanwhile, bind any free port rather than fail the start
    # (a failing start would be restarted into the same failure).
    ports_may_move: bool = False


def bind_or_move(bind: Callable[[int], T], port: int, may_move: bool, what: str) -> T:
    """``bind(port)``; if the port is taken and ``may_move``, ``bind(0)`` (any free port)
    with a warning. Otherwise the ``OSError`` is raised."""
    try:
        return bind(port)
    except OSError as exc:
        if not may_move or port == 0 or exc.errno != errno.EADDRINUSE:
            raise
        log.warning("%s: port %d is taken now; serving on another free port", what, port)
        return bind(0)


@contextlib.asynccontextmanager
async def started(wanted: Wanted, *, manager: SessionManager,
                  snapshot: Callable[[], Coroutine[Any, Any, dict[str, Any]]],
                  home: Path) -> AsyncIterator[dict[str, Any]]:
    if not (wanted.metrics_listen or wanted.web_listen or wanted.tracing):
        yield {}
        return
    from supervisor.telemetry.hub import Sink, Telemetry

    sinks: list[Sink] = []
    bound: dict[str, Any] = {}
    stops: list[Callable[[], None]] = []
    loop = asyncio.get_running_loop()
    try:
        if wanted.tracing:
            from supervisor.telemetry.tracing import SupervisorTracer

            tracer = SupervisorTracer(record_content=wanted.record_content,
                                      endpoint=wanted.otlp_endpoint)
            sinks.append(tracer)
            stops.append(tracer.shutdown)
            hooks.set_hook_observer(tracer.hook)
        if wanted.metrics_listen:
            from prometheus_client import start_http_server

            from supervisor.telemetry.metrics import FarmCollector, FarmMetrics

            metrics = FarmMetrics()
            metrics.registry.register(FarmCollector(loop, snapshot, home / "farm.json"))
            sinks.append(metrics)
            host, port = split_host_port(wanted.metrics_listen)
            server, thread = bind_or_move(
                lambda p: start_http_server(p, host, registry=metrics.registry),
                port, wanted.ports_may_move, "metrics")

            def stop_metrics() -> None:
                server.shutdown()
                server.server_close()
                thread.join(5)

            stops.append(stop_metrics)
            shown = f"[{host}]" if ":" in host else host
            bound["metrics"] = f"http://{shown}:{server.server_port}/metrics"
        if wanted.web_listen:
            from supervisor.telemetry.web import WebView

            web = WebView(wanted.web_listen, manager=manager, snapshot=snapshot,
                          home=home, loop=loop)
            sinks.append(web)
            bound["web"] = bind_or_move(web.start, web.port, wanted.ports_may_move, "web view")
            stops.append(web.stop)
        hub = Telemetry(sinks)
        manager.on_commit = hub.committed
        calls.set_call_observer(hub)
        yield bound
    finally:
        manager.on_commit = None
        calls.set_call_observer(None)
        hooks.set_hook_observer(None)
        for stop in reversed(stops):
            try:
                stop()
            except Exception:  # shutting down: say it, stop the others
                log.exception("telemetry: a stop failed")
