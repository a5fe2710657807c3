"""Where a farm keeps its files, and the child specs that make it up.

A farm lives in a home directory::

    HOME/corral.toml      configuration (a commented default on first run)
    HOME/corral.db        the supervisor's SQLite store (WAL)
    HOME/farm.json        endpoints, pids and versions of the running farm
    HOME/logs/NAME.log    one log per child process
    HOME/exports/         the default export sink
    RUN/                  ipc sockets (HOME/run, or a short /tmp path when
                          HOME is too deep for a unix socket path)

Invariants:
- The home is private to the farm's user: directories 0700, files 0600
  (``secure_home`` sets the umask to 077 in the farm's processes, which their
  children inherit, and tightens what an older farm left wider).
- Endpoints are fixed per home (ipc paths), so a restarted child binds the
  same address and its peers reconnect without being told.
- The scripted provider's port is learned at its first start and pinned for
  its restarts, for the same reason.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from supervisor.farm.tree import ChildSpec

if TYPE_CHECKING:  # the config (and the engine's, with it) loads with Farm, not here
    from supervisor.config import FarmConfig

MAX_IPC_PATH = 90  # sun_path is 108 bytes; leave room for the socket names


@dataclass(frozen=True)
class FarmPaths:
    home: Path
    run: Path

    @classmethod
    def of(cls, home: Path) -> FarmPaths:
        home = home.resolve()
        run = home / "run"
        if len(str(run)) > MAX_IPC_PATH - 20:
            digest = hashlib.sha256(str(home).encode()).hexdigest()[:12]
            run = Path("/tmp") / f"corral-{digest}"
        return cls(home, run)

    @property
    def config(self) -> Path:
        return self.home / "corral.toml"

    @property
    def db(self) -> Path:
        return self.home / "corral.db"

    @property
    def farm_json(self) -> Path:
        return self.home / "farm.json"

    @property
    def logs(self) -> Path:
        return self.home / "logs"

    @property
    def exports(self) -> Path:
        return self.home / "exports"

    @property
    def broker_frontend(self) -> str:
        return f"ipc://{self.run}/broker-front.sock"

    @property
    def broker_backend(self) -> str:
        return f"ipc://{self.run}/broker-back.sock"

    def broker_frontend_of(self, n: int) -> str:
        """Broker ``n``'s frontend (1-based; broker 1 is ``broker_frontend``)."""
        return self.broker_frontend if n == 1 else f"ipc://{self.run}/broker{n}-front.sock"

    def broker_backend_of(self, n: int) -> str:
        return self.broker_backend if n == 1 else f"ipc://{self.run}/broker{n}-back.sock"

    @property
    def supervisor_endpoint(self) -> str:
        return f"ipc://{self.run}/supervisor.sock"

    def supervisor_endpoint_of(self, n: int) -> str:
        """Supervisor ``n``'s client endpoint (1-based; 1 is ``supervisor_endpoint``)."""
        return self.supervisor_endpoint if n == 1 else f"ipc://{self.run}/supervisor{n}.sock"

    def prepare(self) -> None:
        secure_home(self.home)
        for d in (self.home, self.run, self.logs, self.exports):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            # ipc sockets are plain: only the farm's user may reach them.
            os.chmod(d, 0o700)


PRIVATE_FILES = ("corral.db", "corral.db-wal", "corral.db-shm", "farm.json", "routes.json",
                 "routes.owners.json",
                 "corral.toml")


def secure_home(home: Path) -> None:
    """Files this process (and its children) create are 0600/0700; the home and
    the store files an older farm left are made private. (The store, logs and
    sockets must not be readable by other local users: the tools' output and
    the model's messages are in them.)"""
    os.umask(0o077)
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(home, 0o700)
    for name in PRIVATE_FILES:
        try:
            os.chmod(home / name, 0o600, follow_symlinks=False)
        except (OSError, NotImplementedError):
            continue  # absent (or a symlink, which is left alone)


def default_workers() -> int:
    return max(2, os.cpu_count() or 2)


def broker_name(n: int) -> str:
    """The child name of broker ``n``: ``broker``, then ``broker-2``, ``broker-3``..."""
    return "broker" if n == 1 else f"broker-{n}"


def supervisor_name(n: int) -> str:
    """The child name of supervisor ``n``: ``supervisor``, then ``supervisor-2``..."""
    return "supervisor" if n == 1 else f"supervisor-{n}"


def supervisor_id_of(home: Path, n: int) -> str | None:
    """Supervisor ``n``'s lease owner id: supervisor 1 keeps the home's default id (the
    one a farm of one supervisor has), the others add ``-N``; all stable across
    restarts, so a restarted supervisor takes its own sessions back at once."""
    from supervisor.leasing import supervisor_id

    return None if n == 1 else f"{supervisor_id(home)}-{n}"


RESTART_STORE_WAIT_S = 120.0  # under the supervisor's ready timeout (180 s)


def supervisor_specs(paths: FarmPaths, sup_argv: list[str], n_supervisors: int,
                     route_args: Callable[[dict[str, dict[str, Any]]], list[str]],
                     env: dict[str, str] | None,
                     store_wait_s: float = 0.0) -> list[ChildSpec]:
    """The farm's supervisors (``[farm] supervisors``, ``corral up --supervisors``): each
    its own child, restarted alone by the tree, with its own client endpoint, lease
    owner id and so broker identity (supervisor/main.py). ``--metrics`` / ``--web``
    (in ``sup_argv``) go to supervisor 1 only: one port cannot be bound twice."""
    specs = []
    for n in range(1, n_supervisors + 1):
        argv = list(sup_argv)
        argv[argv.index("--listen") + 1] = paths.supervisor_endpoint_of(n)
        if n > 1:
            argv = _without_options(argv, ("--metrics", "--web"))
            argv += ["--supervisor-id", str(supervisor_id_of(paths.home, n))]

        def argv_fn(ready: dict[str, dict[str, Any]], argv: list[str] = argv,
                    name: str = supervisor_name(n)) -> list[str]:
            # A restart (its previous ready line is known) waits for an unreachable
            # store; the first start fails at once, so a wrong [store] url is said now.
            wait = ["--store-wait-s", str(store_wait_s)] if name in ready and store_wait_s \
                else []
            return [*_same_ports(argv, ready.get(name)), *route_args(ready), *wait]

        # Its ready line waits until every stored session is resumed (supervisor/main.py):
        # a large store on a loaded machine needs more than the default 30 s.
        specs.append(ChildSpec(supervisor_name(n), argv, shutdown_timeout_s=10.0,
                               ready_timeout_s=180.0, stage=1, env=env,
                               dynamic_argv=argv_fn))
    return specs


def _same_ports(argv: list[str], previous: dict[str, Any] | None) -> list[str]:
    """On a restart, ``--metrics HOST:0`` / ``--web HOST:0`` become the port the
    previous start bound (its ready line's URLs), so a scrape job or a browser
    pointed at it still finds the restarted supervisor."""
    out = list(argv)
    for option, key in (("--metrics", "metrics"), ("--web", "web")):
        url = (previous or {}).get(key)
        if option not in out[:-1] or not isinstance(url, str):
            continue
        i = out.index(option) + 1
        host, sep, port = out[i].rpartition(":")
        try:
            bound = urlsplit(url).port
        except ValueError:
            bound = None
        if sep and port == "0" and bound:
            out[i] = f"{host}:{bound}"
            if "--ports-may-move" not in out:  # taken meanwhile: any port, not a crash loop
                out.append("--ports-may-move")
    return out


def _without_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        else:
            out.append(arg)
    return out


def broker_specs(cfg: FarmConfig, paths: FarmPaths, argv_of: Callable[[int], list[str]],
                 brokers: int) -> list[ChildSpec]:
    """The farm's brokers (``[farm] brokers``, ``corral up --brokers``): each its own
    child with its own endpoints, restarted alone by the tree. With ``backend_tcp``
    broker N binds the port + N - 1 (port 0: each its own free port)."""
    specs = []
    for n in range(1, brokers + 1):
        argv = [*argv_of(n), "--frontend", paths.broker_frontend_of(n),
                "--backend", paths.broker_backend_of(n)]
        dynamic = None
        if cfg.backend_tcp:
            host, _, port = cfg.backend_tcp.rpartition(":")
            nth = int(port) + n - 1 if int(port) else 0
            argv += _curve_backend_args(paths.home, f"{host}:{nth}")
            dynamic = _pin_backend_tcp(argv, broker_name(n))
        specs.append(ChildSpec(broker_name(n), argv, shutdown_timeout_s=5.0, stage=0,
                               dynamic_argv=dynamic))
    return specs


def child_specs(cfg: FarmConfig, paths: FarmPaths, *, workers: int | None = None,
                brokers: int | None = None, supervisors: int | None = None,
                log_level: str = "INFO", broker_faults: str | None = None,
                broker_faults_seed: int = 0,
                supervisor_env: dict[str, str] | None = None) -> list[ChildSpec]:
    """The farm's children in start order: scripted providers, broker, workers,
    supervisor (stopped in reverse: the supervisor checkpoints first, workers
    drain, the broker goes last). They start in two stages: the providers and
    the broker together, then the workers and the supervisor together (they
    only need the broker's endpoints, which are fixed, and the providers' URLs;
    a request the supervisor sends before any worker has registered waits in
    the broker's queue). The workers stop together, after the supervisor.

    ``broker_faults`` (with its seed) and ``supervisor_env`` are for chaos runs
    only: the broker's frame-fault hook and the store's slow-disk hook."""
    py = sys.executable
    hb = ["--heartbeat-interval-s", str(cfg.heartbeat_interval_s),
          "--liveness", str(cfg.liveness)]
    specs: list[ChildSpec] = []
    route_urls: list[str] = []
    for name, route in sorted(cfg.routes.items()):
        script = route.get("script")
        if not script:
            continue
        argv = [py, "-m", "sandbox_worker.fakellm", "--script", str(script),
                "--host", "127.0.0.1", "--port", "0"]
        specs.append(ChildSpec(f"fakellm-{name}", argv, stage=0,
                               dynamic_argv=_pin_port(f"fakellm-{name}", argv)))
        route_urls.append(name)
    n_brokers = brokers if brokers is not None else cfg.brokers

    def broker_argv(n: int) -> list[str]:
        argv = [py, "-m", "broker", *hb, "--log-level", log_level]
        if broker_faults:
            argv += ["--faults", broker_faults, "--faults-seed", str(broker_faults_seed + n - 1)]
        return argv

    specs += broker_specs(cfg, paths, broker_argv, n_brokers)
    backends = [a for n in range(1, n_brokers + 1) for a in ("--broker",
                                                              paths.broker_backend_of(n))]
    frontends = [a for n in range(1, n_brokers + 1) for a in ("--broker",
                                                               paths.broker_frontend_of(n))]
    # 0 is a real answer (every worker is remote), not "the default".
    n = workers if workers is not None else (
        cfg.workers if cfg.workers is not None else default_workers())
    for i in range(1, n + 1):
        argv = [py, "-m", "sandbox_worker", *backends, *hb,
                "--tier-min", cfg.tier_min, "--log-level", log_level,
                "--images", str(paths.home / "images")]
        if cfg.allow_unsandboxed:
            argv.append("--allow-unsandboxed")
        specs.append(ChildSpec(f"worker-{i}", argv, shutdown_timeout_s=8.0, stage=1,
                               stop_group="workers"))
    sup_argv = [py, "-m", "supervisor", "--home", str(paths.home),
                *frontends, "--listen", paths.supervisor_endpoint,
                *hb, "--log-level", log_level]
    if cfg.metrics_listen:
        sup_argv += ["--metrics", cfg.metrics_listen]
    if cfg.web_listen:
        sup_argv += ["--web", cfg.web_listen]
    # [telemetry] otlp_endpoint reaches every child as the standard variable
    # (one mechanism); an OTEL_* variable of the farm's own environment wins.
    otel: dict[str, str] = {}
    if cfg.otlp_endpoint and not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        otel["OTEL_EXPORTER_OTLP_ENDPOINT"] = cfg.otlp_endpoint
    if otel:
        specs = [replace(spec, env={**otel, **(spec.env or {})}) for spec in specs]
        supervisor_env = {**otel, **(supervisor_env or {})}

    def route_args(ready: dict[str, dict[str, Any]]) -> list[str]:
        urls = []
        for name in route_urls:
            url = ready.get(f"fakellm-{name}", {}).get("url")
            if isinstance(url, str):
                urls += ["--route-url", f"{name}={url}"]
        return urls

    if supervisors is not None:
        from supervisor.config import farm_supervisors  # with Farm, not this module

        n_sup = farm_supervisors(cfg.home / "corral.toml", supervisors, cfg.store_url)
    else:
        n_sup = cfg.supervisors
    store_wait_s = min(cfg.store_outage_s, RESTART_STORE_WAIT_S) if cfg.store_url else 0.0
    specs += supervisor_specs(paths, sup_argv, n_sup, route_args, supervisor_env,
                              store_wait_s)
    return specs


def _curve_backend_args(home: Path, host_port: str) -> list[str]:
    """``[farm] backend_tcp``: the broker also binds a CURVE tcp:// backend for remote
    workers (docs/multihost.md); the farm's keys are made on first use."""
    from supervisor.keys import ensure_farm_keys

    keys = ensure_farm_keys(home)
    return ["--backend-tcp", f"tcp://{host_port}",
            "--curve-secret", str(keys.secret("broker")), "--allow-dir", str(keys.allow_dir)]


def _pin_backend_tcp(argv: list[str], name: str = "broker",
                     ) -> Callable[[dict[str, dict[str, Any]]], list[str]]:
    """Restart the broker on the tcp port it got at its first start (remote workers
    reconnect to the same address)."""

    def argv_fn(ready: dict[str, dict[str, Any]]) -> list[str]:
        bound = ready.get(name, {}).get("tcp", {})
        endpoint = bound.get("backend") if isinstance(bound, dict) else None
        if not isinstance(endpoint, str):
            return argv
        out = list(argv)
        out[out.index("--backend-tcp") + 1] = endpoint
        return out

    return argv_fn


def _pin_port(name: str, argv: list[str]) -> Callable[[dict[str, dict[str, Any]]], list[str]]:
    """Restart a scripted provider on the port it got at its first start."""

    def argv_fn(ready: dict[str, dict[str, Any]]) -> list[str]:
        url = ready.get(name, {}).get("url")
        port = urlsplit(url).port if isinstance(url, str) else None
        if port is None:
            return argv
        out = list(argv)
        out[out.index("--port") + 1] = str(port)
        return out

    return argv_fn


def write_farm_json(paths: FarmPaths, info: dict[str, Any]) -> None:
    tmp = paths.farm_json.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(info, indent=2, sort_keys=True))
    os.replace(tmp, paths.farm_json)


def read_farm_json(paths: FarmPaths) -> dict[str, Any] | None:
    try:
        data = json.loads(paths.farm_json.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None
