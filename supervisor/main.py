"""The supervisor process: ``python -m supervisor --home DIR --broker EP --listen EP``.

It opens the SQLite store (the only writer), connects to the broker as a
client, resumes every active session, and serves clients on ``--listen``.
Readiness is one JSON line on stdout once it serves. SIGTERM stops
gracefully: sessions are checkpointed (every step is committed before it is
visible, so stopping never loses a step), then the store is closed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import zmq

from broker.endpoints import bind_endpoint, connect_endpoint
from broker.lifeline import watch_parent
from broker.security import CurveClient, Guard, KeyFileError
from broker.taskdump import install_task_dump
from sandbox_worker.api import ModelRoute
from supervisor import config as config_mod
from supervisor import leasing
from supervisor.brokers import add_broker_option, broker_link, resolve_brokers, wants_curve
from supervisor.clienttools import ClientToolHost
from supervisor.engine.config import EngineConfig
from supervisor.engine.manager import SessionManager
from supervisor.engine.routers import add_router, remove_router
from supervisor.export import DirectorySink, HttpSink
from supervisor.facade import Facade
from supervisor.farm.layout import secure_home
from supervisor.keys import farm_keys
from supervisor.server import ClientServer
from supervisor.store import StoreError, StoreUnavailable
from supervisor.store.opening import open_store
from supervisor.telemetry import setup as telemetry

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m supervisor",
        description="Corral supervisor: owns every session and their durable state. "
        "Prints one JSON ready line on stdout once it serves clients.")
    p.add_argument("--home", type=Path, required=True,
                   help="the farm's home (corral.toml, corral.db)")
    add_broker_option(p)
    p.add_argument("--listen", required=True, type=bind_endpoint,
                   help="client endpoint to bind, e.g. ipc://HOME/run/supervisor.sock")
    p.add_argument("--db", type=Path, default=None,
                   help="SQLite store path (default HOME/corral.db; unused with [store] url)")
    p.add_argument("--supervisor-id", default=None,
                   help="this supervisor's id in the leases of a shared PostgreSQL store "
                   "(default: HOSTNAME-HASH_OF_HOME, stable across restarts)")
    p.add_argument("--advertise", default=None, metavar="ENDPOINT", type=connect_endpoint,
                   help="the client endpoint other supervisors of a shared store send this "
                   "one's clients to (default: the bound --listen endpoint, with a wildcard "
                   "host replaced by this host's name)")
    p.add_argument("--route-url", action="append", default=[], metavar="NAME=URL",
                   help="base URL of a scripted route's provider (given by the farm)")
    p.add_argument("--heartbeat-interval-s", type=float, default=0.25,
                   help="seconds between heartbeats to the broker (default 0.25; [farm] "
                   "heartbeat_interval_s in a farm)")
    p.add_argument("--liveness", type=int, default=4,
                   help="missed heartbeats before the broker counts as gone (default 4)")
    p.add_argument("--curve", action="store_true",
                   help="CURVE + ZAP with the farm's keys (HOME/keys, see docs/multihost.md) "
                   "on a tcp:// --listen, and towards a tcp:// --broker")
    p.add_argument("--metrics", default=None, metavar="HOST:PORT",
                   help="serve Prometheus /metrics here (default: [telemetry] metrics_listen)")
    p.add_argument("--web", default=None, metavar="HOST:PORT",
                   help="serve the read-only live web view here (default: [web] listen)")
    p.add_argument("--ports-may-move", action="store_true",
                   help="if the --metrics or --web port is taken, serve on any free port "
                   "instead of failing (the farm sets it on a restart, whose ports it pins "
                   "to the first start's)")
    p.add_argument("--store-wait-s", type=float, default=0.0, metavar="S",
                   help="at start-up, wait up to S seconds for an unreachable store "
                   "(PostgreSQL) before exiting with status 2 (default 0: exit at once; "
                   "the farm gives a restarted supervisor [store] outage_wait_s, at most "
                   "120 s)")
    p.add_argument("--log-level", default="INFO",
                   help="log level on stderr (default INFO)")
    return p


def engine_config(cfg: config_mod.FarmConfig, route_urls: dict[str, str]) -> EngineConfig:
    routes: dict[str, ModelRoute] = {}
    for name, route in cfg.routes.items():
        routes[name] = ModelRoute(**route)
        if name in route_urls:
            routes[name]["base_url"] = route_urls[name]
    return EngineConfig(
        routes=routes,
        default_route=cfg.default_route,
        instructions=cfg.instructions,
        max_model_steps=cfg.max_model_steps,
        max_turn_s=cfg.turn_timeout_s,
        approval_timeout_s=cfg.approval_timeout_s or None,
        model_call_budget_s=cfg.model_call_budget_s,
        tool_call_budget_s=cfg.tool_call_budget_s,
        compaction_threshold_tokens=cfg.compaction_threshold_tokens,
        store_outage_s=cfg.store_outage_s,
    )


def session_defaults(cfg: config_mod.FarmConfig) -> dict[str, Any]:
    """What a session gets from corral.toml unless its creator says otherwise."""
    policy: dict[str, Any] = {"tier_min": cfg.tier_min, "network": cfg.network,
                              "limits": dict(cfg.limits)}
    if cfg.allow_unsandboxed:
        policy["allow_unsandboxed"] = True
    if cfg.sandbox_mode != "workspace-write":
        policy["sandbox_mode"] = cfg.sandbox_mode
    if cfg.git_writable:
        policy["git_writable"] = True
    return {
        "approval": {"default": cfg.approval, "allow": list(cfg.allow),
                     "deny": list(cfg.deny), "ask": list(cfg.ask)},
        "tool_policy": policy,
        "instructions": cfg.instructions,
        # [[hooks.EVENT]] from corral.toml: command hooks run in the sandbox.
        "hooks": [dict(h) for h in cfg.hooks],
        # [mcp.NAME] / [tools.NAME] as SessionSpec fields; a session's own
        # entries (the create request's mcp / tools) override these per name.
        "mcp": dict(cfg.mcp),
        "command_tools": dict(cfg.command_tools),
    }


def export_sinks(cfg: config_mod.FarmConfig) -> list[Any]:
    sinks: list[Any] = []
    for sink in cfg.export_sinks:
        if sink["type"] == "directory":
            path = Path(sink.get("path", "exports"))
            sinks.append(DirectorySink(path if path.is_absolute() else cfg.home / path))
        else:
            sinks.append(HttpSink(str(sink["url"]), timeout_s=float(sink.get("timeout_s", 10))))
    if not sinks:
        sinks.append(DirectorySink(cfg.home / "exports"))
    return sinks


def broker_identity(db: Path, supervisor_id: str | None = None) -> bytes:
    """The supervisor's broker identity: the same for every process of one supervisor.

    A restarted supervisor then says HEARTBEAT under its predecessor's identity
    with a new instance id, and the broker drops the dead process's requests at
    once (``client_restarts``: queued ones forgotten, running ones cancelled)
    instead of keeping them for the 10 s client window, where a queued tool
    call could still start after the new process had resumed its session.

    On SQLite one store file has one supervisor, so the file names it. On a shared
    PostgreSQL store several supervisors of one home are live at once: each is named
    by its lease owner id (``supervisor_id``, stable across its restarts), so two of
    them never share an identity (the broker would route one's replies to the other)."""
    key = f"pg:{supervisor_id}" if supervisor_id else str(db.resolve())
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return f"c-supervisor-{socket.gethostname()[:32]}-{digest}".encode()


async def serve(ns: argparse.Namespace) -> int:
    home: Path = ns.home.resolve()
    secure_home(home)  # corral.db and the other files of the home are 0600
    try:
        cfg = config_mod.load(home)
    except config_mod.ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    problem = resolve_brokers(ns, cfg.broker_lists[0], str(home / "corral.toml"))
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    urls = dict(item.split("=", 1) for item in ns.route_url)
    econf = engine_config(cfg, urls)
    try:
        guard, broker_curve = _security(ns, home)
    except KeyFileError as exc:
        print(f"error: {exc} (create the farm's keys with: corral keys init)", file=sys.stderr)
        return 2
    lease_opts = leasing.lease_options(cfg.store_url, home, cfg.store_lease_s,
                                       ns.supervisor_id)
    try:
        store = await opening_waited(ns.store_wait_s, functools.partial(
            open_store, db=ns.db or home / "corral.db", url=cfg.store_url, home=home,
            **lease_opts))
    except StoreError as exc:  # unreachable, another schema version, not Corral's, ...
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    try:
        in_use = await leasing.id_in_use(store)
    except StoreError as exc:  # unknown: start (the lease rounds ride out an outage)
        log.warning("could not check whether this supervisor id is in use: %s", exc.message)
        in_use = None
    if in_use is not None:
        await store.close()
        print(f"error: {in_use}", file=sys.stderr)
        return 2
    client_host = ClientToolHost(store)  # client tools and hooks (docs/tools.md)
    add_router(client_host)
    try:
        async with broker_link(ns, curve=broker_curve,
                               identity=broker_identity(ns.db or home / "corral.db",
                                                        lease_opts.get("owner")),
                               ) as broker, contextlib.AsyncExitStack() as stack:
            manager = SessionManager(store=store, broker=broker, config=econf,
                                     export_sinks=export_sinks(cfg),
                                     middleware_factory=client_host.middlewares)
            facade = Facade(manager=manager, store=store, broker=broker,
                            engine_config=econf, home=home, defaults=session_defaults(cfg))
            manager.before_take_over = facade.reload_inline_routes
            wanted = telemetry.Wanted(
                metrics_listen=ns.metrics or cfg.metrics_listen,
                web_listen=ns.web or cfg.web_listen,
                tracing=telemetry.tracing_wanted(cfg.otlp_endpoint),
                otlp_endpoint=cfg.otlp_endpoint, record_content=cfg.record_content,
                ports_may_move=ns.ports_may_move)
            seen = await stack.enter_async_context(telemetry.started(
                wanted, manager=manager, snapshot=facade.status, home=home))
            server = ClientServer(facade, ns.listen, guard=guard, client_host=client_host,
                                  locate=functools.partial(leasing.redirect, store,
                                                           manager.sessions),
                                  place=functools.partial(leasing.place, store))
            bound = server.bind()
            if bound.startswith("ipc://"):
                with contextlib.suppress(OSError):
                    os.chmod(bound[len("ipc://"):], 0o600)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            if guard is not None:
                loop.add_signal_handler(signal.SIGHUP, guard.request_reload)
            install_task_dump(loop)
            await _serve_until_stopped(ns, store, manager, server, bound, stop, seen)
    finally:
        remove_router(client_host)
        await store.close()
        if guard is not None:
            guard.close()
    return 0


async def opening_waited(wait_s: float, open_fn: Callable[[], Awaitable[Any]]) -> Any:
    """``open_fn()``, retried every second for up to ``wait_s`` while the store is
    unreachable (a supervisor restarted during a PostgreSQL outage waits for it rather
    than exiting, which the farm's tree would restart until it gave the farm up)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max(0.0, wait_s)
    told = False
    while True:
        try:
            return await open_fn()
        except StoreUnavailable as exc:
            if loop.time() + 1.0 > deadline:
                raise
            if not told:
                told = True
                log.warning("waiting up to %.0fs for the store: %s", wait_s, exc.message)
            await asyncio.sleep(1.0)


class _Stopping(Exception):
    """Raised inside the serving task group once a stop is asked: the group then
    cancels every task it holds (the engine, the client server, the lease keeper,
    and whatever is added later), not only the ones named here. Before, only the
    engine and the server were cancelled: the lease keeper of a PostgreSQL
    supervisor kept the group open until the farm's 10 s stop timeout killed it."""


async def _serve_until_stopped(ns: argparse.Namespace, store: Any, manager: SessionManager,
                               server: ClientServer, bound: str, stop: asyncio.Event,
                               seen: dict[str, Any]) -> None:
    try:
        async with asyncio.TaskGroup() as tg:
            await leasing.start(store, manager, tg)  # PostgreSQL: take the leases
            await leasing.advertise(store, advertised(ns.advertise, bound))
            tg.create_task(manager.run())
            tg.create_task(server.run())
            # Ready means serving: the stored sessions are resumed first, so a
            # client's first describe or submit finds them (not a race). A stop
            # asked meanwhile is not held up by the resume.
            resumed = tg.create_task(manager.started())
            stopping = tg.create_task(stop.wait())
            await asyncio.wait({resumed, stopping}, return_when=asyncio.FIRST_COMPLETED)
            resumed.cancel()
            stopping.cancel()
            if not stop.is_set():
                sys.stdout.write(json.dumps({"event": "ready", "pid": os.getpid(),
                                             "listen": bound, "broker": ns.broker[0],
                                             "brokers": ns.broker, **seen}) + "\n")
                sys.stdout.flush()
            await stop.wait()
            log.info("stopping: no new calls; sessions are checkpointed at every step")
            raise _Stopping
    except* _Stopping:
        pass
    # The engine has stopped (every task of the group ended): nothing more is written
    # for the sessions, so their leases go to the other supervisors now.
    await leasing.sign_off(store)


def advertised(given: str | None, bound: str) -> str:
    """Where clients reach this supervisor: ``given``, else the bound endpoint with a
    wildcard host (``0.0.0.0``, ``*``, ``[::]``) replaced by this host's name."""
    if given:
        return given
    for wildcard in ("tcp://0.0.0.0:", "tcp://*:", "tcp://[::]:"):
        if bound.startswith(wildcard):
            return f"tcp://{socket.getfqdn()}:{bound[len(wildcard):]}"
    return bound


def _security(ns: argparse.Namespace, home: Path) -> tuple[Guard | None, CurveClient | None]:
    """The client endpoint's guard and the broker connection's keys (``--curve``)."""
    if not ns.curve:
        return None, None
    fk = farm_keys(home)
    guard = Guard(zmq.Context.instance(), fk.supervisor_server())
    curve = fk.supervisor_as_client() if wants_curve(ns) else None
    return guard, curve


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    watch_parent()  # exit if the farm's root dies without stopping us
    return asyncio.run(serve(ns))
