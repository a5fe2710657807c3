"""A farm for engine tests: real broker, real workers, the scripted provider,
a real SQLite store and a ``SessionManager`` in the test process.

``start_farm(procs, tmp_path, script)`` starts ``python -m broker`` (ipc://
endpoints under tmp_path), ``workers`` times ``python -m sandbox_worker`` and
``python -m sandbox_worker.fakellm``, each confirmed by its JSON ready line
under a deadline (never a sleep). ``engine(...)`` is an async context manager
that opens the store and broker client and runs a ``SessionManager`` in a
TaskGroup, cancelling it on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import tempfile
import urllib.request
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from broker.client import BrokerClient
from sandbox_worker.api import ModelRoute
from supervisor.engine import EngineConfig, Middleware, SessionManager, SessionSpec
from supervisor.store import Store
from supervisor.store.records import EventRecord, SessionId
from tests.helpers import PYTHON, Procs, read_line_with_deadline

READY_TIMEOUT_S = 30.0
# Workspaces live under /tmp (mode 0755): the sandbox user must be able to reach
# them, and pytest's tmp_path sits under a 0700 directory. conftest removes them.
CREATED_WORKSPACES: list[Path] = []


def new_workspace() -> Path:
    path = Path(tempfile.mkdtemp(prefix="corral-engine-ws-", dir="/tmp"))
    path.chmod(0o755)
    CREATED_WORKSPACES.append(path)
    return path


@dataclass
class Farm:
    procs: Procs
    tmp: Path
    frontend: str
    backend: str
    llm_url: str
    script_path: Path
    broker: subprocess.Popen[bytes]
    llm: subprocess.Popen[bytes]
    ws: Path
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def add_worker(self, services: str = "tool,model", capacity: int = 8,
                   extra: Sequence[str] = ()) -> subprocess.Popen[bytes]:
        proc = self.procs.spawn(
            [PYTHON, "-m", "sandbox_worker", "--broker", self.backend, "--services", services,
             "--capacity", str(capacity), "--log-level", "WARNING", *extra],
            name="worker", stdout=subprocess.PIPE)
        _ready(proc)
        self.workers.append(proc)
        return proc

    def route(self, name: str = "main", **extra: Any) -> ModelRoute:
        route = ModelRoute(name=name, provider="openai-responses", model="scripted",
                           base_url=self.llm_url, native_compaction=True,
                           context_window=100_000, max_retries=0)
        route.update(extra)  # type: ignore[typeddict-item]
        return route

    def llm_get(self, path: str) -> Any:
        with urllib.request.urlopen(self.llm_url.rstrip("/") + path, timeout=10) as resp:
            return json.loads(resp.read())

    def llm_requests(self, path: str = "/responses") -> list[dict[str, Any]]:
        """The recorded request bodies the provider received on ``path``, oldest first."""
        return [r for r in self.llm_get("/_corral/requests")
                if r["path"] in (path, "/v1" + path)]

    def _by_path(self, path: str) -> int:
        by_path = self.llm_get("/_corral/stats")["by_path"]
        return int(by_path.get(path, 0)) + int(by_path.get("/v1" + path, 0))

    def model_responses(self) -> int:
        """Requests served on /responses (the möbius ``model.responses``)."""
        return self._by_path("/responses")

    def compactions(self) -> int:
        """Requests served on /responses/compact (the möbius ``model.compactions``)."""
        return self._by_path("/responses/compact")


def _ready(proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    """Read the JSON ready line, then close our end of the pipe (children write
    nothing else to stdout)."""
    try:
        line: dict[str, Any] = json.loads(read_line_with_deadline(proc, READY_TIMEOUT_S))
    finally:
        if proc.stdout is not None:
            proc.stdout.close()
    if line.get("event") != "ready":
        raise AssertionError(f"pid {proc.pid} did not report ready: {line}")
    return line


def write_script(tmp: Path, script: dict[str, Any], name: str = "script.json") -> Path:
    path = tmp / name
    path.write_text(json.dumps(script))
    return path


def start_farm(procs: Procs, tmp: Path, script: dict[str, Any], *, workers: int = 1,
               capacity: int = 8, services: str = "tool,model") -> Farm:
    # The broker's liveness window is the farm's default (0.25 s x 4 = 1 s). At
    # 0.5 s a loaded CI machine stalled live workers past it: each false expiry
    # fails their in-flight calls, and a model step retried, or a session whose
    # three attempts were all cut, made the engine tests fail for no bug.
    sock = tmp / "s"
    sock.mkdir(exist_ok=True)
    broker = procs.spawn(
        [PYTHON, "-m", "broker", "--frontend", f"ipc://{sock}/front",
         "--backend", f"ipc://{sock}/back", "--heartbeat-interval-s", "0.25", "--liveness", "4"],
        name="broker", stdout=subprocess.PIPE)
    ready = _ready(broker)
    script_path = write_script(tmp, script)
    llm = procs.spawn([PYTHON, "-m", "sandbox_worker.fakellm", "--script", str(script_path),
                       "--port", "0", "--max-recorded", "256"],
                      name="fakellm", stdout=subprocess.PIPE)
    llm_ready = _ready(llm)
    farm = Farm(procs, tmp, ready["frontend"], ready["backend"], llm_ready["url"], script_path,
                broker, llm, new_workspace())
    for _ in range(workers):
        farm.add_worker(services, capacity)
    return farm


@dataclass
class Engine:
    manager: SessionManager
    store: Store
    client: BrokerClient
    farm: Farm

    async def session(self, **spec: Any) -> SessionId:
        spec.setdefault("workspace", str(self.farm.ws))
        return await self.manager.create_session(SessionSpec(**spec))

    async def run_until(self, sid: SessionId, op: dict[str, Any] | None,
                        until: Callable[[EventRecord], bool] | None = None,
                        timeout_s: float = 30.0,
                        after_sequence: int = 0) -> list[EventRecord]:
        """Subscribe, submit ``op``, collect events until ``until`` (default: a terminal
        turn event of this submission)."""
        collected: list[EventRecord] = []
        sub_id = None
        it = self.manager.subscribe(sid, after_sequence=after_sequence)
        if op is not None:
            sub_id = await self.manager.submit(sid, op)

        def default(e: EventRecord) -> bool:
            return e.type in ("turn_complete", "turn_aborted") and (
                sub_id is None or e.submission_id == sub_id)
        stop = until or default
        async with asyncio.timeout(timeout_s):
            async for record in it:
                collected.append(record)
                if stop(record):
                    break
        await it.aclose()  # type: ignore[attr-defined]
        return collected


@contextlib.asynccontextmanager
async def engine(farm: Farm, *, routes: dict[str, ModelRoute] | None = None,
                 middleware: Callable[[SessionSpec], Sequence[Middleware]] | None = None,
                 db: Path | None = None, **config: Any) -> AsyncIterator[Engine]:
    routes = routes or {"main": farm.route("main")}
    observer = config.pop("usage_observer", None)
    sinks = config.pop("export_sinks", ())
    cfg = EngineConfig(routes=routes, **config)
    store = await Store.open(db or farm.tmp / "engine.sqlite3")
    try:
        async with BrokerClient(farm.frontend) as client:
            manager = SessionManager(store=store, broker=client, config=cfg,
                                     middleware_factory=middleware, usage_observer=observer,
                                     export_sinks=sinks)
            async with asyncio.TaskGroup() as tg:
                task = tg.create_task(manager.run())
                async with asyncio.timeout(30):
                    await manager.started()
                try:
                    yield Engine(manager, store, client, farm)
                finally:
                    task.cancel()
    finally:
        await store.close()


def types(events: list[EventRecord]) -> list[str]:
    return [e.type for e in events]


@dataclass
class FarmPool:
    """Brokers and workers shared by the tests of a module, one set per
    ``(services, workers)``, started at first use (a worker start is ~1.2
    CPU-s, a broker's ~0.3). ``farm(...)`` gives a test a ``Farm`` over them
    with its own scripted provider, tmp directory (its store) and workspace.

    Only for tests that neither kill, add nor reconfigure a worker or the
    broker: the workers and the broker outlive the test, and are killed by
    pid with the pool's ``Procs`` when the module ends."""

    procs: Procs
    tmp: Path
    shared: dict[tuple[str, int], Farm] = field(default_factory=dict)

    def farm(self, procs: Procs, tmp: Path, script: dict[str, Any], *, workers: int = 1,
             services: str = "tool,model") -> Farm:
        base = self.shared.get((services, workers))
        if base is None:
            where = self.tmp / f"pool-{len(self.shared)}"
            where.mkdir()
            base = start_farm(self.procs, where, {"responses": []}, workers=workers,
                              services=services)
            self.shared[(services, workers)] = base
        dead = [p.pid for p in [base.broker, *base.workers] if p.poll() is not None]
        if dead:
            raise AssertionError(f"a shared farm process died: {dead}")
        script_path = write_script(tmp, script)
        llm = procs.spawn([PYTHON, "-m", "sandbox_worker.fakellm", "--script", str(script_path),
                           "--port", "0", "--max-recorded", "256"],
                          name="fakellm", stdout=subprocess.PIPE)
        return Farm(procs, tmp, base.frontend, base.backend, _ready(llm)["url"], script_path,
                    base.broker, llm, new_workspace(), list(base.workers))
