"""The sandbox worker process: registers the ``tool`` and ``model`` services
with the broker and serves them until told to stop.

Invariants:
- This process never runs tool code itself: the tool service starts every
  call as a sandboxed child process tree.
- Heartbeats are the broker worker's own task; handlers never block the loop.
- Readiness is a handshake: one JSON line on stdout once registered
  (``{"event": "ready", ...}``), nothing else is written to stdout.
- SIGTERM drains: no new work, in-flight requests finish or fail within
  ``--drain-s``, then the worker disconnects and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from broker import otel
from broker.endpoints import connect_endpoint
from broker.lifeline import watch_parent
from broker.security import CurveClient, KeyFileError
from broker.slots import SlotPool
from broker.taskdump import install_task_dump
from broker.worker import BrokerWorker, RequestContext
from sandbox_worker import tracing
from sandbox_worker.api import PIN_SEP, SERVICE_MODEL, SERVICE_TOOL, image_service

log = logging.getLogger(__name__)
MAX_BROKERS = 8  # brokers one worker serves at once (--broker repeated)


class Service(Protocol):
    async def start(self) -> None: ...
    async def handle(self, ctx: RequestContext) -> bytes: ...
    def info(self) -> dict[str, Any]: ...
    async def aclose(self) -> None: ...


def _tool_module() -> Any:
    from sandbox_worker.tools import service

    return service


def _model_module() -> Any:
    from sandbox_worker.model import service

    return service


# Service name → module providing add_arguments, config_from_args and the class.
SERVICE_MODULES: dict[str, tuple[Callable[[], Any], str]] = {
    SERVICE_TOOL: (_tool_module, "ToolService"),
    SERVICE_MODEL: (_model_module, "ModelService"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sandbox_worker",
        description="Corral sandbox worker: serves model calls and sandboxed tool calls "
        "for a broker. Prints one JSON ready line on stdout once registered.",
    )
    parser.add_argument("--broker", required=True, action="append", type=connect_endpoint,
                        help="broker backend endpoint, e.g. ipc:///run/corral/backend or "
                        "tcp://10.0.0.1:5556; repeat it to serve several brokers at once "
                        "(the capacity is shared among them: docs/multihost.md)")
    parser.add_argument("--services", default="tool,model",
                        help="comma-separated services to serve (default: tool,model)")
    parser.add_argument("--capacity", type=int, default=4,
                        help="requests served at once by this worker (default: 4)")
    parser.add_argument("--heartbeat-interval-s", type=float, default=0.25,
                        help="seconds between heartbeats to each broker (default 0.25)")
    parser.add_argument("--liveness", type=int, default=4,
                        help="missed heartbeats before the broker counts as gone")
    parser.add_argument("--drain-s", type=float, default=5.0,
                        help="on SIGTERM, seconds to let in-flight work finish")
    parser.add_argument("--server-key", type=Path, default=None, metavar="FILE",
                        help="the broker's public key file (CURVE on a tcp:// broker)")
    parser.add_argument("--key", type=Path, default=None, metavar="FILE",
                        help="this worker's key pair (NAME.key_secret), on the broker's "
                        "allow-list with role worker")
    parser.add_argument("--log-level", default="INFO",
                        help="log level on stderr (default INFO)")
    for load, _cls in SERVICE_MODULES.values():
        with contextlib.suppress(ImportError):
            load().add_arguments(parser)
    return parser


async def serve(ns: argparse.Namespace) -> int:
    names = [s.strip() for s in ns.services.split(",") if s.strip()]
    unknown = [n for n in names if n not in SERVICE_MODULES]
    if unknown or not names:
        print(f"error: unknown service(s) {unknown}; choose from {sorted(SERVICE_MODULES)}",
              file=sys.stderr)
        return 2
    services: dict[str, Service] = {}
    for name in names:
        load, cls_name = SERVICE_MODULES[name]
        module = load()
        services[name] = getattr(module, cls_name)(module.config_from_args(ns))
    try:
        for svc in services.values():
            await svc.start()
    except Exception as exc:
        # A start-up refusal (e.g. sandbox tier below the minimum) is the
        # operator's to fix: say what and exit non-zero, without a traceback.
        print(f"error: {exc}", file=sys.stderr)
        for svc in services.values():
            await svc.aclose()
        return 3
    curve = None
    if ns.server_key is not None or ns.key is not None:
        try:
            if ns.server_key is None or ns.key is None:
                raise KeyFileError("give both, or neither")
            curve = CurveClient.from_files(ns.server_key, ns.key)
        except KeyFileError as exc:
            print(f"error: --server-key and --key: {exc}", file=sys.stderr)
            return 2
    info: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(),
                            "capacity": ns.capacity}
    for name, svc in services.items():
        info[name] = svc.info()
    if otel.wanted():  # OTEL_EXPORTER_OTLP_ENDPOINT (docs/operations.md)
        tracing.install()
    handlers: dict[str, Callable[[RequestContext], Awaitable[bytes]]] = {
        name: tracing.wrap(name, svc.handle) for name, svc in services.items()
    }
    tool_service = services.get(SERVICE_TOOL)
    if tool_service is not None:
        # This worker's own name for the tool service: MCP calls of a session
        # whose server it holds are sent here (docs/tools.md, "Affinity").
        pin = f"{SERVICE_TOOL}{PIN_SEP}{uuid.uuid4().hex[:16]}"
        handlers[pin] = tracing.wrap(SERVICE_TOOL, tool_service.handle)
        tool_service.mcp.pin = pin  # type: ignore[attr-defined]
        # One name per image this worker holds (docs/images.md): a call of a
        # session in that image is sent to a worker serving its name.
        for digest in info[SERVICE_TOOL].get("images", {}).get("held", []):
            handlers[image_service(digest)] = tracing.wrap(SERVICE_TOOL, tool_service.handle)
    try:
        links = broker_links(ns, handlers, info, curve)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    def ready() -> None:
        line = {"event": "ready", "pid": os.getpid(), "services": names,
                "broker": ns.broker[0], "brokers": ns.broker, "info": info}
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()

    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    install_task_dump(loop)
    try:
        async with asyncio.TaskGroup() as tg:
            run_task = tg.create_task(run_links(links, ready))

            async def stop_on_signal() -> None:
                await stopping.wait()
                log.info("draining for up to %.1fs", ns.drain_s)
                async with asyncio.TaskGroup() as stops:
                    for link in links:
                        stops.create_task(link.stop(drain_s=ns.drain_s))
                run_task.cancel()

            stopper = tg.create_task(stop_on_signal())
            with contextlib.suppress(asyncio.CancelledError):
                await run_task
            stopper.cancel()
    finally:
        for svc in services.values():
            await svc.aclose()
        tracing.shutdown()  # flushes the spans not exported yet
    return 0


def broker_links(ns: argparse.Namespace,
                 handlers: dict[str, Callable[[RequestContext], Awaitable[bytes]]],
                 info: dict[str, Any], curve: CurveClient | None) -> list[BrokerWorker]:
    """One ``BrokerWorker`` per ``--broker``, all under one identity; with several
    they share one ``SlotPool`` of ``--capacity`` slots (broker/slots.py)."""
    endpoints = list(dict.fromkeys(ns.broker))
    if len(endpoints) > MAX_BROKERS:
        raise ValueError(f"at most {MAX_BROKERS} brokers (--broker given {len(endpoints)} "
                         "times)")
    pool = SlotPool(ns.capacity) if len(endpoints) > 1 else None
    identity = f"w-{uuid.uuid4().hex}".encode()
    return [BrokerWorker(ep, handlers, capacity=ns.capacity, info=info,
                         heartbeat_interval_s=ns.heartbeat_interval_s, liveness=ns.liveness,
                         curve=curve if len(endpoints) == 1 or ep.startswith("tcp://") else None,
                         identity=identity, pool=pool)
            for ep in endpoints]


async def run_links(links: list[BrokerWorker], ready: Callable[[], None]) -> None:
    """Serve every broker until each link's ``run`` ends; ``ready`` once, when the
    first broker acknowledges (a broker that is down does not hold the worker)."""
    said = False

    def first() -> None:
        nonlocal said
        if not said:
            said = True
            ready()

    async with asyncio.TaskGroup() as tg:
        for link in links:
            tg.create_task(link.run(on_ready=first), name=f"broker-link-{link.endpoint}")


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(
        level=ns.log_level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
    )
    watch_parent()  # exit if the farm's root dies without stopping us
    return asyncio.run(serve(ns))
