"""Running a farm: the root process (``corral up``), detaching, and stopping.

``Farm`` wraps a ``SupervisionTree`` of the farm's children and keeps
``HOME/farm.json`` true while it runs: endpoints, the root's pid, every
child's pid and restart count, and versions. The file appears only once
every child has reported ready (``state: "serving"``), which is what
``corral up --detach`` and an ephemeral ``corral run`` wait for.

Invariants:
- ``farm.json`` is replaced atomically and removed when the farm stops.
- Stopping the farm stops every child in reverse start order and reaps them;
  ``stop_detached`` then checks by pid that none is left and kills stragglers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import psutil

from broker import plants
from supervisor import __version__
from supervisor.farm.layout import FarmPaths, child_specs, read_farm_json, write_farm_json
from supervisor.farm.tree import SupervisionTree, last_error_line

log = logging.getLogger(__name__)
VERSION = __version__


class Farm:
    def __init__(self, home: Path, *, workers: int | None = None, log_level: str = "INFO",
                 broker_faults: str | None = None, broker_faults_seed: int = 0,
                 supervisor_env: dict[str, str] | None = None, max_restarts: int = 20,
                 within_s: float = 60.0, on_change: Callable[[], None] | None = None,
                 temporary: bool = False, metrics: str | None = None,
                 web: str | None = None, brokers: int | None = None,
                 supervisors: int | None = None) -> None:
        if os.environ.get(plants.ENV):  # planted bugs never run in a normal farm
            raise RuntimeError(f"{plants.ENV} is set: planted bugs are only for the "
                               "processes `corral chaos --plant` starts; unset it")
        # The config module (and the engine's config with it) loads here, not
        # with this module: corral status and down need only running_farm and
        # stop_detached (0.2 CPU-s of imports per call).
        from supervisor import config as config_mod

        self.paths = FarmPaths.of(home)
        self.paths.prepare()
        config_mod.write_default(self.paths.home)
        self.config = config_mod.load(self.paths.home)
        if metrics or web:  # corral up --metrics/--web win over corral.toml
            self.config = dataclasses.replace(
                self.config, metrics_listen=metrics or self.config.metrics_listen,
                web_listen=web or self.config.web_listen)
        self.specs = child_specs(self.config, self.paths, workers=workers, brokers=brokers,
                                 supervisors=supervisors, log_level=log_level,
                                 broker_faults=broker_faults,
                                 broker_faults_seed=broker_faults_seed,
                                 supervisor_env=supervisor_env)
        self.tree = SupervisionTree(self.specs, log_dir=self.paths.logs,
                                    max_restarts=max_restarts, within_s=within_s,
                                    on_change=self._write_state)
        self.serving = False
        # The farm of one 'corral run' (stops with it); said in farm.json.
        self.temporary = temporary
        self.started_at = time.time()
        self._extra_on_change = on_change

    def info(self) -> dict[str, Any]:
        return {
            "state": "serving" if self.serving else "starting",
            "root_pid": os.getpid(),
            "home": str(self.paths.home),
            "version": VERSION,
            "python": sys.version.split()[0],
            "started_at": self.started_at,
            "endpoints": {
                "broker_frontend": self.paths.broker_frontend,
                "broker_backend": self.paths.broker_backend,
                "supervisor": self.paths.supervisor_endpoint,
                **self._broker_endpoints(),
                **self._supervisor_endpoints(),
            },
            "children": self.tree.status(),
            "restarts": list(self.tree.restart_log),
            "temporary": self.temporary,
        }

    def _broker_endpoints(self) -> dict[str, list[str]]:
        """With several brokers: every broker's endpoints, broker 1 first."""
        names = [s.name for s in self.specs if s.name.startswith("broker")]
        if len(names) < 2:
            return {}
        n = range(1, len(names) + 1)
        return {"broker_frontends": [self.paths.broker_frontend_of(i) for i in n],
                "broker_backends": [self.paths.broker_backend_of(i) for i in n]}

    def _supervisor_endpoints(self) -> dict[str, list[str]]:
        """With several supervisors: every supervisor's client endpoint, 1 first."""
        n = sum(1 for s in self.specs if s.name.startswith("supervisor"))
        if n < 2:
            return {}
        return {"supervisors": [self.paths.supervisor_endpoint_of(i) for i in range(1, n + 1)]}

    def _write_state(self) -> None:
        if self._extra_on_change is not None:
            self._extra_on_change()
        if self.serving:
            write_farm_json(self.paths, self.info())

    def _ready(self) -> None:
        self.serving = True
        self._write_state()

    async def run(self) -> None:
        """Run until cancelled; the tree is stopped and farm.json removed on exit."""
        try:
            await self.tree.run(on_ready=self._ready)
        finally:
            self.serving = False
            with contextlib.suppress(FileNotFoundError):
                self.paths.farm_json.unlink()


    @contextlib.asynccontextmanager
    async def started(self) -> AsyncIterator[None]:
        """Start the farm and keep it supervised (and farm.json true) for the body;
        stop it on exit. A start-up failure raises here, before the body runs
        (``ChildFailedToStart`` with the child's own error line)."""
        try:
            await self.tree.start()
            self._ready()
            task = asyncio.create_task(self.tree.supervise(), name="farm-supervise")
            try:
                yield
            finally:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    current = asyncio.current_task()
                    if current is not None and current.cancelling():
                        raise  # we are being cancelled ourselves: never swallow that
        finally:
            self.serving = False
            with contextlib.suppress(FileNotFoundError):
                self.paths.farm_json.unlink()


async def serve_forever(farm: Farm) -> int:
    """The root process's main: run until SIGTERM/SIGINT, then stop gracefully."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await farm.run()
    except asyncio.CancelledError:
        log.info("farm stopped")
        return 0
    except BaseExceptionGroup as group:
        for exc in group.exceptions:
            print(f"corral: farm failed: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # start-up failure: say what and where to look
        print(f"corral: farm failed: {exc}", file=sys.stderr)
        return 1
    return 0


def running_farm(home: Path) -> dict[str, Any] | None:
    """The farm serving ``home``, if its root process is alive."""
    info = read_farm_json(FarmPaths.of(home))
    if not info or info.get("state") != "serving":
        return None
    pid = info.get("root_pid")
    if not isinstance(pid, int) or not psutil.pid_exists(pid):
        return None
    return info


def start_detached(home: Path, *, workers: int | None, timeout_s: float = 90.0,
                   log_level: str = "INFO", metrics: str | None = None,
                   web: str | None = None, brokers: int | None = None,
                   supervisors: int | None = None) -> dict[str, Any]:
    """Start the root process in the background; return once the farm serves."""
    paths = FarmPaths.of(home)
    paths.prepare()
    argv = [sys.executable, "-m", "supervisor.farm", "--home", str(paths.home),
            "--log-level", log_level]
    if workers is not None:
        argv += ["--workers", str(workers)]
    if brokers is not None:
        argv += ["--brokers", str(brokers)]
    if supervisors is not None:
        argv += ["--supervisors", str(supervisors)]
    if metrics:
        argv += ["--metrics", metrics]
    if web:
        argv += ["--web", web]
    with contextlib.suppress(FileNotFoundError):
        paths.farm_json.unlink()
    log_path = paths.logs / "farm.log"
    with open(log_path, "ab") as out:
        offset = out.tell()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = running_farm(home)
        if info is not None:
            return info
        if proc.poll() is not None:
            why = last_error_line(log_path, offset).removeprefix("corral: ")
            raise RuntimeError(
                f"the farm exited during start-up (exit {proc.returncode})"
                f"{': ' + why if why else ''}; full log: {log_path}")
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"the farm did not serve within {timeout_s:.0f}s; "
                       f"see {paths.logs / 'farm.log'}")


def stop_detached(home: Path, *, timeout_s: float = 60.0) -> list[int]:
    """Stop a detached farm; return the pids that had to be killed (none if clean)."""
    info = read_farm_json(FarmPaths.of(home))
    if not info:
        return []
    pids = [c["pid"] for c in info.get("children", []) if isinstance(c.get("pid"), int)]
    root = info.get("root_pid")
    if isinstance(root, int) and psutil.pid_exists(root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(root, signal.SIGTERM)
        with contextlib.suppress(psutil.Error):
            psutil.Process(root).wait(timeout_s)
    killed = []
    for pid in [*pids, *([root] if isinstance(root, int) else [])]:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                p.kill()
                killed.append(pid)
    return killed
