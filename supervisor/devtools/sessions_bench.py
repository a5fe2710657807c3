"""Sessions benchmark: ``python -m supervisor.devtools.sessions_bench [--quick] [--json]``.

What the supervisor costs per turn, against a minimal agent loop doing the
same work. One farm is started (our broker process, ``--workers`` sandbox
workers with the ``tool`` and ``model`` services, the scripted provider on
loopback HTTP) and both paths run N concurrent sessions x M turns on it, in
the same run. A turn is one ``shell`` tool call and one final answer (the
script holds 2 entries per turn: the provider picks entry k by the number of
model outputs already in the request).

- ``supervisor``: the full path. A ``SessionManager`` in this process with a
  real SQLite store (``Store``) and a ``BrokerClient`` to the broker: each
  turn is ``submit`` → model call → tool call in bwrap on a worker → model
  call → ``turn_complete`` seen by a subscriber, with every durable commit.
  The manager runs in-process (not the ``python -m supervisor`` process
  behind ``SupervisorClient``) so that the process measured for CPU and
  memory is exactly the one running the engine, and tracemalloc can see it;
  the client/server wire in front of it is not part of the per-turn cost.
- ``minimal``: ``python -m sandbox_worker.devtools.bench_minimal`` in a child process:
  httpx to the same provider (same wire format, streamed), the same tool run
  with the worker's own sandbox code (``run_shell``: setpriv, prlimit, bwrap),
  no broker, no persistence. Its concurrent calls are bounded by the farm's
  total worker capacity, so both paths get the same parallelism.

Results per level (1, 100 and, without ``--quick``, 1,000 sessions): turns/s
of both paths, and the CPU per turn of the supervisor process (plus, for
diagnosis, of the broker, the workers, their sandboxed children and the
provider). Memory per idle session: RSS growth of this process over
``--idle`` freshly created idle sessions (``idle_session_bytes``, measured
before any traffic so freed arenas cannot hide growth) and tracemalloc's
figure beside it. Ratios: supervisor turns/s over minimal turns/s per level
(``throughput100_vs_minimal`` is the target: ≥ 0.7); compare only within one
run. With ``--telemetry`` the supervisor levels run a second time in the same
run with metrics (scraped every second) and traces (exported over OTLP/HTTP to
a local sink) on in the supervisor process: ``telemetry_on_vs_off_N`` and
``throughputN_vs_minimal_telemetry_on`` (issue 18's bound: at most a 10% drop);
``--telemetry-rounds K`` alternates K on and off phases after the first off
one and compares the means (``telemetry_on_vs_off_mean_N``).
The broker and the workers are the same processes in both phases and do not
trace. Issue 19's figures: ``--pg`` runs the 100-session level again on a PostgreSQL
store (``pg_vs_sqlite``, with how many steps took the one-statement path);
``--takeover`` measures ``takeover_s`` (``takeover_bench``); ``--two-supervisors``
measures ``two_supervisors_vs_one`` (``supervisors_bench``); ``--takeover-only`` and
``--two-supervisors-only`` skip the levels.

Invariants: every turn is checked (one tool call ended ``ok``, then
``turn_complete``), a failed turn fails the run; every child is started in
its own session, confirmed by its JSON ready line under a deadline, and
killed and reaped on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import platform
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from broker.client import BrokerClient
from sandbox_worker.api import ModelRoute
from supervisor.engine.config import EngineConfig, SessionSpec
from supervisor.engine.manager import SessionManager
from supervisor.store import Store
from supervisor.store.records import EventRecord, SessionId, StepWrite

READY_TIMEOUT_S = 60.0
TURN_TIMEOUT_S = 120.0
MINIMAL_TIMEOUT_S = 1800.0
REPO = Path(__file__).resolve().parents[2]
QUICK_LEVELS = ((1, 10), (100, 3))
FULL_LEVELS = ((1, 30), (100, 5), (1000, 2))


STUCK_REPORTED: list[bool] = []


class BenchFailed(RuntimeError):
    """A child did not start, or a turn did not complete as scripted."""


def read_json_line(proc: subprocess.Popen[bytes], timeout_s: float) -> dict[str, Any]:
    """One JSON line of a child's stdout, under a deadline."""
    if proc.stdout is None:
        raise BenchFailed("child has no stdout pipe")
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    buf = b""
    deadline = time.monotonic() + timeout_s
    try:
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise BenchFailed(f"pid {proc.pid} wrote no line within {timeout_s:g} s")
            chunk = os.read(proc.stdout.fileno(), 1)  # one byte: leave the next line unread
            if not chunk:
                raise BenchFailed(f"pid {proc.pid} exited (rc {proc.poll()}) before its line")
            buf += chunk
    finally:
        sel.close()
    line: dict[str, Any] = json.loads(buf.decode())
    return line


@contextlib.contextmanager
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
            if p.stdout is not None:
                p.stdout.close()


def spawn(procs: list[subprocess.Popen[bytes]], *argv: str,
          stderr: Path | None = None) -> subprocess.Popen[bytes]:
    with contextlib.ExitStack() as stack:
        err = stack.enter_context(stderr.open("wb")) if stderr else subprocess.DEVNULL
        proc = subprocess.Popen([sys.executable, "-m", *argv], stdout=subprocess.PIPE,
                                stderr=err, start_new_session=True, cwd=REPO)
    procs.append(proc)
    return proc


def spawn_ready(procs: list[subprocess.Popen[bytes]], *argv: str) -> dict[str, Any]:
    proc = spawn(procs, *argv)
    line = read_json_line(proc, READY_TIMEOUT_S)
    if line.get("event") != "ready":
        raise BenchFailed(f"{argv[0]} (pid {proc.pid}) did not report ready: {line}")
    return line


def start_farm(procs: list[subprocess.Popen[bytes]], tmp: Path, script: Path, workers: int,
               capacity: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, list[int]]]:
    """A broker on ``ipc://`` sockets in ``tmp``, the scripted provider (``script``) and
    ``workers`` workers (tool and model, ``capacity`` slots each), ready, in ``procs``:
    the broker's and the provider's ready lines and the pids by role (for the meters)."""
    b = spawn_ready(procs, "broker", "--frontend", f"ipc://{tmp}/front",
                    "--backend", f"ipc://{tmp}/back")
    llm = spawn_ready(procs, "sandbox_worker.fakellm", "--script", str(script),
                      "--port", "0", "--max-recorded", "1")
    for _ in range(workers):
        spawn_ready(procs, "sandbox_worker", "--broker", b["backend"], "--services",
                    "tool,model", "--capacity", str(capacity), "--log-level", "WARNING")
    roles = {"broker": [procs[0].pid], "provider": [procs[1].pid],
             "workers": [p.pid for p in procs[2:]]}
    return b, llm, roles


def write_script(path: Path, turns: int) -> None:
    responses: list[dict[str, Any]] = []
    for t in range(turns):
        responses.append({"tool_calls": [{"name": "shell", "call_id": f"call_{t}",
                                          "arguments": {"command": "echo turn"}}]})
        responses.append({"text": f"turn {t} done"})
    path.write_text(json.dumps({"responses": responses}))


class CpuMeter:
    """CPU seconds (user + system) of this process and of the farm's children."""

    def __init__(self, roles: dict[str, list[int]]) -> None:
        self.me = psutil.Process()
        self.roles = {role: [psutil.Process(pid) for pid in pids] for role, pids in roles.items()}

    def sample(self) -> dict[str, float]:
        t = self.me.cpu_times()
        out = {"supervisor": t.user + t.system}
        for role, procs in self.roles.items():
            own = kids = 0.0
            for p in procs:
                c = p.cpu_times()
                own += c.user + c.system
                kids += c.children_user + c.children_system
            out[role] = own
            if role == "workers":
                out["tool_children"] = kids
        return out

    @staticmethod
    def per_turn_ms(before: dict[str, float], after: dict[str, float],
                    turns: int) -> dict[str, float]:
        return {f"{k}_cpu_ms_per_turn": round((after[k] - before[k]) / turns * 1000, 3)
                for k in before}


def _spec(ws: str) -> SessionSpec:
    return SessionSpec(workspace=ws, approval="allow")  # the default tool limits


async def _drive(manager: SessionManager, sid: SessionId, turns: int,
                 on_stuck: Callable[[], Awaitable[None]] | None = None) -> None:
    """Run ``turns`` turns of one session, one at a time, checking each."""
    it = manager.subscribe(sid, after_sequence=0).__aiter__()
    try:
        for t in range(turns):
            sub = await manager.submit(sid, {"type": "user_input", "text": f"turn {t}"})
            ok_calls = 0
            seen: list[str] = []
            ends: list[Any] = []
            try:
                async with asyncio.timeout(TURN_TIMEOUT_S):
                    while True:
                        e: EventRecord = await anext(it)
                        if e.submission_id != sub:
                            continue
                        seen.append(e.type)
                        if e.type == "tool_call_end" and e.payload.get("outcome") == "ok":
                            ok_calls += 1
                        elif e.type == "tool_call_end":
                            ends.append({k: e.payload.get(k) for k in (
                                "outcome", "error_kind", "error", "exit_code")})
                        if e.type == "turn_aborted":
                            raise BenchFailed(f"session {sid} turn {t} aborted: {e.payload}")
                        if e.type == "turn_complete":
                            break
            except TimeoutError:
                if on_stuck is not None:
                    await on_stuck()
                st = manager.sessions[sid].state
                raise BenchFailed(
                    f"session {sid} turn {t} did not end within {TURN_TIMEOUT_S:g} s; "
                    f"events {seen[-6:]}, turn {st.active_turn}, "
                    f"tool calls {st.pending_tool_calls}") from None
            if ok_calls != 1:
                raise BenchFailed(f"session {sid} turn {t}: {ok_calls} ok tool calls, not 1 "
                                  f"({str(ends)[:500]})")
    finally:
        await it.aclose()  # type: ignore[attr-defined]


class StepCounter:
    """Counts the steps the engine commits (each a ``StepWrite`` with its events)."""

    def __init__(self, manager: SessionManager) -> None:
        self.steps = self.events = 0
        inner = manager.store_commit

        async def counted(step: StepWrite) -> None:
            self.steps += 1
            self.events += len(step.events)
            await inner(step)
        manager.store_commit = counted  # type: ignore[method-assign]


async def _supervisor_level(manager: SessionManager, ws: str, meter: CpuMeter,
                            counter: StepCounter, n: int, m: int,
                            on_stuck: Callable[[], Awaitable[None]]) -> dict[str, Any]:
    sids = [await manager.create_session(_spec(ws)) for _ in range(n)]
    steps0, events0 = counter.steps, counter.events
    lag = manager.loop_lag  # the engine's own gauge (engine/looplag.py)
    lag.reset()
    before = meter.sample()
    started = time.monotonic()
    # gather, not a TaskGroup: one stuck session must not cancel the others
    # (nor the diagnostics of the first one) before they all report
    outcomes = await asyncio.gather(*(_drive(manager, sid, m, on_stuck) for sid in sids),
                                    return_exceptions=True)
    failures = [o for o in outcomes if isinstance(o, BaseException)]
    if failures:
        await on_stuck()
        raise BenchFailed(f"{len(failures)} of {n} sessions failed; the first: {failures[0]}")
    wall = time.monotonic() - started
    after = meter.sample()
    turns = n * m
    return {"sessions": n, "turns_each": m, "turns": turns, "wall_s": round(wall, 3),
            "turns_per_s": round(turns / wall, 2), **CpuMeter.per_turn_ms(before, after, turns),
            "commits_per_turn": round((counter.steps - steps0) / turns, 2),
            "durable_events_per_turn": round((counter.events - events0) / turns, 2),
            "loop_lag_max_s": round(lag.max_s, 3)}


async def _settle(manager: SessionManager) -> None:
    drivers = [s.driver for s in manager.sessions.values() if s.driver is not None]
    if drivers:
        await asyncio.wait(drivers, timeout=60)
    gc.collect()


async def _idle_memory(manager: SessionManager, ws: str, n: int) -> dict[str, Any]:
    """RSS growth per idle session, then (a separate batch) tracemalloc's figure."""
    me = psutil.Process()
    await _settle(manager)
    rss0 = me.memory_info().rss
    for _ in range(n):
        await manager.create_session(_spec(ws))
    await _settle(manager)
    rss1 = me.memory_info().rss
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(n):
            await manager.create_session(_spec(ws))
        await _settle(manager)
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    traced = sum(s.size_diff for s in after.compare_to(before, "filename"))
    return {"idle_sessions": n, "idle_session_bytes": round((rss1 - rss0) / n),
            "idle_session_tracemalloc_bytes": round(traced / n)}


def _minimal(procs: list[subprocess.Popen[bytes]], url: str, ws: str,
             levels: tuple[tuple[int, int], ...], slots: int, log: Path) -> dict[str, Any]:
    spec = ",".join(f"{n}:{m}" for n, m in levels)
    proc = spawn(procs, "sandbox_worker.devtools.bench_minimal", "--url", url, "--workspace", ws,
                 "--levels", spec, "--slots", str(slots), stderr=log)
    try:
        ready = read_json_line(proc, READY_TIMEOUT_S)
        result = read_json_line(proc, MINIMAL_TIMEOUT_S)
        proc.wait(timeout=30)
    except BenchFailed as exc:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        raise BenchFailed(f"the minimal loop failed: {exc}: {' / '.join(tail)}") from None
    if ready.get("event") != "ready" or result.get("event") != "result" or proc.returncode:
        raise BenchFailed(f"the minimal loop failed (rc {proc.returncode}): {result}")
    out: dict[str, Any] = result["levels"]
    out["tier"] = ready.get("tier")
    return out


# The collector and the scraper of a farm are other processes: here one small
# process that drops every OTLP/HTTP post and scrapes the metrics URL it is
# given on stdin every second, so their CPU is not counted as the supervisor's.
_OUTSIDE = """
import sys, threading, time, urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class Sink(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
threading.Thread(target=server.serve_forever, daemon=True).start()
print(server.server_address[1], flush=True)
url = sys.stdin.readline().strip()
while True:
    try:
        urllib.request.urlopen(url, timeout=5).read()
    except OSError:
        pass
    time.sleep(1.0)
"""


@contextlib.asynccontextmanager
async def _telemetry_on(manager: SessionManager, client: BrokerClient,
                        home: Path) -> AsyncIterator[None]:
    """Metrics (scraped every second) and traces (exported over OTLP/HTTP to a
    sink that drops them) on in this process, as a farm with both has them; the
    sink and the scraper run in a process of their own (``_OUTSIDE``)."""
    from supervisor.telemetry import setup as telemetry

    outside = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _OUTSIDE, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, start_new_session=True)
    pipe_in, pipe_out = outside.stdin, outside.stdout
    try:
        if pipe_in is None or pipe_out is None:
            raise RuntimeError("the sink process has no pipes")
        async with asyncio.timeout(60):
            port = int(await pipe_out.readline())
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{port}"

        async def status() -> dict[str, Any]:
            return {"broker": await client.status(timeout_s=2.0), "sessions": manager.stats()}

        wanted = telemetry.Wanted(metrics_listen="127.0.0.1:0", tracing=True)
        async with telemetry.started(wanted, manager=manager, snapshot=status,
                                     home=home) as bound:
            pipe_in.write(f"{bound['metrics']}\n".encode())
            await pipe_in.drain()
            yield
    finally:
        os.environ.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
        outside.kill()
        await outside.wait()


def _mean_levels(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """Per level, the mean of every numeric figure over ``phases``."""
    out: dict[str, Any] = {}
    for n, first in phases[0].items():
        out[n] = {k: (round(sum(p[n][k] for p in phases) / len(phases), 3)
                      if isinstance(v, int | float) and not isinstance(v, bool) else v)
                  for k, v in first.items()}
    return out


async def _pg_vs_sqlite(sqlite_manager: SessionManager, client: BrokerClient,
                        route: ModelRoute, ws: str, meter: CpuMeter, n: int, m: int,
                        on_stuck: Callable[[], Awaitable[None]]) -> dict[str, Any]:
    """The same level on the SQLite store (again, now) and on a PostgreSQL store (a
    throwaway durable cluster on loopback: fsync on), one supervisor each, same farm."""
    from supervisor.devtools.pgserver import PgServer
    from supervisor.store.pg import onestep
    from supervisor.store.pg.store import PgStore

    sqlite = await _supervisor_level(sqlite_manager, ws, meter, StepCounter(sqlite_manager),
                                     n, m, on_stuck)
    server = await asyncio.to_thread(PgServer.start, durable=True)
    try:
        store = await PgStore.open(await asyncio.to_thread(server.new_database))
        try:
            manager = SessionManager(store=store, broker=client,
                                     config=EngineConfig(routes={"main": route}))
            async with asyncio.TaskGroup() as tg:
                task = tg.create_task(manager.run())
                try:
                    async with asyncio.timeout(READY_TIMEOUT_S):
                        await manager.started()
                    counter = StepCounter(manager)
                    await _supervisor_level(manager, ws, meter, counter, 1, 1, on_stuck)
                    groups0, counts0 = store.groups_committed, dict(onestep.COUNTS)
                    pg = await _supervisor_level(manager, ws, meter, counter, n, m, on_stuck)
                    groups = store.groups_committed - groups0
                    paths = {k: v - counts0.get(k, 0) for k, v in onestep.COUNTS.items()}
                finally:
                    task.cancel()
        finally:
            await store.close()
    finally:
        await asyncio.to_thread(server.stop)
    return {"sqlite": sqlite, "postgresql": pg, "postgresql_transactions": groups,
            "postgresql_step_paths": paths,
            "ratio": round(pg["turns_per_s"] / sqlite["turns_per_s"], 3)}


async def bench(tmp: Path, levels: tuple[tuple[int, int], ...], workers: int, capacity: int,
                idle: int, telemetry: int = 0, pg: bool = False) -> dict[str, Any]:
    script = tmp / "script.json"
    write_script(script, max(m for _, m in levels) + 1)
    ws = tmp / "ws"
    ws.mkdir()
    for path in (tmp, ws):  # the sandbox uid must reach the workspace
        path.chmod(0o755)
    with children() as procs:
        b, llm, roles = start_farm(procs, tmp, script, workers, capacity)
        meter = CpuMeter(roles)
        route = ModelRoute(name="main", provider="openai-responses", model="scripted",
                           base_url=llm["url"], max_retries=0)
        results: dict[str, Any] = {"workers": workers, "capacity_per_worker": capacity}
        results["minimal"] = _minimal(procs, llm["url"], str(ws), levels, workers * capacity,
                                     tmp / "minimal.log")
        store = await Store.open(tmp / "bench.sqlite3")
        try:
            async with BrokerClient(b["frontend"]) as client:
                manager = SessionManager(store=store, broker=client,
                                         config=EngineConfig(routes={"main": route}))
                async with asyncio.TaskGroup() as tg:
                    task = tg.create_task(manager.run())
                    try:
                        async with asyncio.timeout(READY_TIMEOUT_S):
                            await manager.started()
                        results["idle"] = await _idle_memory(manager, str(ws), idle)
                        counter = StepCounter(manager)
                        async def on_stuck() -> None:
                            await _report_stuck(llm["url"], client)
                        await _supervisor_level(manager, str(ws), meter, counter, 1, 1,
                                                on_stuck)  # warm-up
                        sup: dict[str, Any] = {}
                        for n, m in levels:
                            sup[str(n)] = await _supervisor_level(manager, str(ws), meter,
                                                                  counter, n, m, on_stuck)
                        results["supervisor"] = sup
                        if pg:  # issue 19: the PostgreSQL store against SQLite, 100 sessions
                            n, m = next(((n, m) for n, m in levels if n == 100), levels[-1])
                            results["pg_vs_sqlite"] = await _pg_vs_sqlite(
                                manager, client, route, str(ws), meter, n, m, on_stuck)
                        # The same levels again with metrics and traces on, then off,
                        # alternated ``telemetry`` times: the drift of the machine's
                        # load spreads over both (on is compared with the mean of
                        # every off phase, the first included).
                        ons: list[dict[str, Any]] = []
                        offs: list[dict[str, Any]] = []
                        for _ in range(telemetry):
                            tel: dict[str, Any] = {}
                            async with _telemetry_on(manager, client, tmp):
                                # warm-up: the exporter's and the scrape's first
                                # use import and set up (seconds on a loaded box)
                                await _supervisor_level(manager, str(ws), meter, counter,
                                                        1, 2, on_stuck)
                                for n, m in levels:
                                    tel[str(n)] = await _supervisor_level(
                                        manager, str(ws), meter, counter, n, m, on_stuck)
                            ons.append(tel)
                            again: dict[str, Any] = {}
                            for n, m in levels:
                                again[str(n)] = await _supervisor_level(
                                    manager, str(ws), meter, counter, n, m, on_stuck)
                            offs.append(again)
                        if ons:
                            results["supervisor_telemetry"] = _mean_levels(ons)
                            results["supervisor_off_again"] = _mean_levels(offs)
                            results["telemetry_rounds"] = len(ons)
                    finally:
                        task.cancel()
        finally:
            await store.close()
    return results


async def _report_stuck(url: str, client: BrokerClient) -> None:
    """When a turn is stuck or failed, say where the model calls stand: the provider's
    counters, the broker's STATUS (without worker info) and the client's calls
    in flight. On stderr, best effort, once per run."""
    if STUCK_REPORTED:
        return
    STUCK_REPORTED.append(True)

    def provider() -> Any:
        with urllib.request.urlopen(url.rstrip("/") + "/_corral/stats", timeout=5) as resp:
            return json.loads(resp.read())
    try:
        stats = await asyncio.to_thread(provider)
        print(f"provider: {stats.get('requests')} requests served, {stats.get('active')} "
              f"active, by status {stats.get('by_status')}; broker client: "
              f"{len(client._calls)} calls in flight", file=sys.stderr)
        status = await client.status(timeout_s=5)
        brief = {k: status.get(k) for k in ("queues", "requests_tracked", "queued_bytes",
                                            "counters", "clients")}
        brief["workers"] = {svc: [(w.get("in_flight"), w.get("answered"))
                                  for w in entry.get("workers", [])]
                            for svc, entry in status.get("workers", {}).items()}
        print(f"broker status: {json.dumps(brief, default=str)[:4000]}", file=sys.stderr)
    except Exception as exc:  # diagnostics only: the stuck turn fails the run anyway
        print(f"stuck-turn diagnostics unavailable: {exc!r}", file=sys.stderr)


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg": [round(x, 2) for x in os.getloadavg()]}


def summarize(results: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
    sup, mini = results["supervisor"], results["minimal"]
    ratios = {f"throughput{n}_vs_minimal": round(sup[n]["turns_per_s"] / mini[n]["turns_per_s"], 3)
              for n in sup}
    headline = {"idle_session_bytes": results["idle"]["idle_session_bytes"],
                "idle_session_tracemalloc_bytes":
                    results["idle"]["idle_session_tracemalloc_bytes"]}
    for n in sup:
        headline[f"supervisor_turns_per_s_{n}"] = sup[n]["turns_per_s"]
        headline[f"minimal_turns_per_s_{n}"] = mini[n]["turns_per_s"]
    tel = results.get("supervisor_telemetry") or {}
    for n in tel:
        ratios[f"throughput{n}_vs_minimal_telemetry_on"] = round(
            tel[n]["turns_per_s"] / mini[n]["turns_per_s"], 3)
        ratios[f"telemetry_on_vs_off_{n}"] = round(
            tel[n]["turns_per_s"] / sup[n]["turns_per_s"], 3)
        again = (results.get("supervisor_off_again") or {}).get(n)
        if again:  # on against the mean of every off phase (the first, and after each on)
            k = int(results.get("telemetry_rounds", 1))
            off_tps = (sup[n]["turns_per_s"] + k * again["turns_per_s"]) / (k + 1)
            off_cpu = (sup[n]["supervisor_cpu_ms_per_turn"]
                       + k * again["supervisor_cpu_ms_per_turn"]) / (k + 1)
            ratios[f"telemetry_on_vs_off_mean_{n}"] = round(tel[n]["turns_per_s"] / off_tps, 3)
            ratios[f"cpu_per_turn_on_vs_off_mean_{n}"] = round(
                tel[n]["supervisor_cpu_ms_per_turn"] / off_cpu, 3)
        headline[f"supervisor_turns_per_s_{n}_telemetry_on"] = tel[n]["turns_per_s"]
    pvs = results.get("pg_vs_sqlite")
    if pvs:
        ratios["pg_vs_sqlite"] = pvs["ratio"]
        headline["pg_turns_per_s"] = pvs["postgresql"]["turns_per_s"]
        headline["sqlite_turns_per_s_same_phase"] = pvs["sqlite"]["turns_per_s"]
    key = "100" if "100" in sup else next(iter(sup))
    headline["supervisor_cpu_ms_per_turn"] = sup[key]["supervisor_cpu_ms_per_turn"]
    headline["minimal_cpu_ms_per_turn"] = mini[key]["cpu_ms_per_turn"]
    return headline, ratios


def print_table(results: dict[str, Any], ratios: dict[str, float]) -> None:
    sup, mini = results["supervisor"], results["minimal"]
    print(f"{'sessions':>8} {'x turns':>7} | {'minimal t/s':>11} {'cpu ms/t':>8} | "
          f"{'supervisor t/s':>14} {'cpu ms/t':>8} {'broker':>7} {'workers':>7} "
          f"{'tools':>7} {'llm':>6} | {'ratio':>6}")
    for n in sup:
        s, mn = sup[n], mini[n]
        print(f"{n:>8} {s['turns_each']:>7} | {mn['turns_per_s']:>11.1f} "
              f"{mn['cpu_ms_per_turn']:>8.2f} | {s['turns_per_s']:>14.1f} "
              f"{s['supervisor_cpu_ms_per_turn']:>8.2f} {s['broker_cpu_ms_per_turn']:>7.2f} "
              f"{s['workers_cpu_ms_per_turn']:>7.2f} {s['tool_children_cpu_ms_per_turn']:>7.2f} "
              f"{s['provider_cpu_ms_per_turn']:>6.2f} | "
              f"{ratios[f'throughput{n}_vs_minimal']:>6.3f}")
    for n, t in (results.get("supervisor_telemetry") or {}).items():
        print(f"{n:>8} {t['turns_each']:>7} | telemetry on: {t['turns_per_s']:>8.1f} t/s, "
              f"cpu {t['supervisor_cpu_ms_per_turn']:.2f} ms/t | ratio to minimal "
              f"{ratios[f'throughput{n}_vs_minimal_telemetry_on']:.3f}, on/off "
              f"{ratios[f'telemetry_on_vs_off_{n}']:.3f}")
    pvs = results.get("pg_vs_sqlite")
    if pvs:
        print(f"pg_vs_sqlite: {pvs['postgresql']['sessions']} sessions x "
              f"{pvs['postgresql']['turns_each']}: PostgreSQL {pvs['postgresql']['turns_per_s']}"
              f" t/s (supervisor cpu {pvs['postgresql']['supervisor_cpu_ms_per_turn']} ms/t), "
              f"SQLite {pvs['sqlite']['turns_per_s']} t/s (cpu "
              f"{pvs['sqlite']['supervisor_cpu_ms_per_turn']} ms/t): ratio {pvs['ratio']}")
    idle = results["idle"]
    print(f"idle session: {idle['idle_session_bytes']} B RSS "
          f"({idle['idle_session_tracemalloc_bytes']} B tracemalloc), "
          f"over {idle['idle_sessions']} sessions; sandbox tier {mini.get('tier')}")


def _levels(text: str) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for part in text.split(","):
        n, _, m = part.partition(":")
        if not (n.isdigit() and m.isdigit()) or int(n) < 1 or int(m) < 1:
            raise argparse.ArgumentTypeError(f"level {part!r} is not N:M (positive integers)")
        out.append((int(n), int(m)))
    return tuple(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m supervisor.devtools.sessions_bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 and 100 sessions, under 60 s")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object and write bench-results/sessions.json")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--capacity", type=int, default=32, help=(
        "per worker; keep workers x capacity x 3 under the tools' per-uid process limit (256)"))
    parser.add_argument("--idle", type=int, default=0,
                        help="idle sessions for the memory figure (default 1000, --quick 300)")
    parser.add_argument("--telemetry", action="store_true", help=(
        "run the levels again with metrics (scraped every second) and traces (OTLP/HTTP "
        "to a local sink) on in the supervisor; report on/off ratios"))
    parser.add_argument("--telemetry-rounds", type=int, default=1, metavar="K", help=(
        "with --telemetry: alternate K on and off phases after the first off one "
        "(default 1: off, on, off); the ratios use the means of the phases"))
    parser.add_argument("--pg", action="store_true", help=(
        "also run the 100-session level on a PostgreSQL store (a throwaway durable cluster "
        "from Debian's postgresql package) against SQLite: pg_vs_sqlite"))
    parser.add_argument("--takeover", action="store_true", help=(
        "also measure takeover_s (supervisor/devtools/takeover_bench.py): p50/p99 from a "
        "supervisor's SIGKILL to its sessions' next progress on another supervisor of a "
        "PostgreSQL store; target p99 <= lease + 1 s"))
    parser.add_argument("--takeover-only", action="store_true",
                        help="measure takeover_s only (no levels)")
    parser.add_argument("--two-supervisors", action="store_true", help=(
        "also measure two_supervisors_vs_one (supervisor/devtools/supervisors_bench.py): "
        "turns/s of 1,000 sessions (--quick: 100) x 2 turns on two supervisor processes "
        "pinned to separate cores over one, on one PostgreSQL store; target >= 1.4; then "
        "the same with each supervisor under a CPU quota (_supervisor_bound)"))
    parser.add_argument("--two-supervisors-only", action="store_true",
                        help="measure two_supervisors_vs_one only (no levels)")
    parser.add_argument("--lease-s", type=float, default=2.0,
                        help="[store] lease_s of the takeover run (default 2)")
    parser.add_argument("--levels", type=_levels, default=None,
                        help="N:M[,N:M...] instead of the default levels (for profiling)")
    args = parser.parse_args(argv)
    idle = args.idle or (300 if args.quick else 1000)
    started = time.monotonic()
    results: dict[str, Any] = {}
    only = args.takeover_only or args.two_supervisors_only
    if not only:
        with tempfile.TemporaryDirectory(prefix="corral-bench-", dir="/tmp") as tmp:
            levels = args.levels or (QUICK_LEVELS if args.quick else FULL_LEVELS)
            results = asyncio.run(bench(Path(tmp), levels, args.workers, args.capacity, idle,
                                        max(1, args.telemetry_rounds) if args.telemetry
                                        else 0, args.pg))
    headline, ratios = summarize(results) if results else ({}, {})
    results.update(headline)
    if args.takeover or args.takeover_only:
        from supervisor.devtools import takeover_bench

        took = takeover_bench.run(10 if args.quick else 50, args.lease_s, args.workers)
        results["takeover_s"] = took
        ratios["takeover_p99_vs_target"] = round(took["p99"] / took["target_p99"], 3)
    if args.two_supervisors or args.two_supervisors_only:
        from supervisor.devtools import supervisors_bench

        two = supervisors_bench.run(100 if args.quick else 1000, 2, args.workers,
                                    args.capacity)
        results["two_supervisors_vs_one"] = two
        ratios.update(supervisors_bench.ratios(two))
    results["seconds"] = round(time.monotonic() - started, 1)
    if args.json:
        doc = {"name": "sessions", "machine": machine(), "results": results, "ratios": ratios}
        out = REPO / "bench-results"
        out.mkdir(exist_ok=True)
        (out / "sessions.json").write_text(json.dumps(doc, indent=2) + "\n")
        print(json.dumps(doc))
    else:
        if not only:
            print_table(results, ratios)
        if shown := results.get("takeover_s"):
            print(f"takeover_s ({shown['sessions']} sessions, lease {shown['lease_s']}s): "
                  f"p50 {shown['p50']}s, p99 {shown['p99']}s, max {shown['max']}s "
                  f"(target p99 <= {shown['target_p99']}s)")
        if two_run := results.get("two_supervisors_vs_one"):
            from supervisor.devtools import supervisors_bench

            print(supervisors_bench.describe(two_run))
        print(f"({results['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
