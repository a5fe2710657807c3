"""Session engine benchmark: ``python -m supervisor.engine.bench [--quick] [--json]``.

What a turn costs on top of the model call it makes. One farm (our broker
process, model workers, the scripted provider over loopback HTTP, a SQLite
store in a temp dir) is measured two ways in the same run:

- ``raw``: the bare model call a one-step turn needs (``BrokerClient`` →
  broker → worker → provider), the baseline;
- ``engine``: whole turns through ``SessionManager`` (submit → turn_complete
  seen by a subscriber): admission, five durable commits, the event fan-out.

Results: p50/p99 latency at 1 in flight, throughput with N sessions (turns)
in flight, and the memory of an idle session (tracemalloc). Ratios: engine
over raw for latency and throughput. Compare only within one run.

Invariants: every child process is started in its own session, confirmed by
its JSON ready line under a deadline, and killed and reaped on exit.
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
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from broker.client import BrokerClient
from broker.protocol import pack, unpack
from sandbox_worker.api import ModelRoute
from supervisor.engine.config import EngineConfig, SessionSpec
from supervisor.engine.manager import SessionManager
from supervisor.store import Store
from supervisor.store.records import SessionId

READY_TIMEOUT_S = 30.0


def _ready_line(proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    if proc.stdout is None:
        raise RuntimeError("child has no stdout pipe")
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    buf = b""
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise RuntimeError(f"pid {proc.pid} did not report ready")
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"pid {proc.pid} exited before it was ready")
            buf += chunk
    finally:
        sel.close()
        proc.stdout.close()
    line: dict[str, Any] = json.loads(buf.decode().splitlines()[0])
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


def spawn(procs: list[subprocess.Popen[bytes]], *argv: str) -> dict[str, Any]:
    proc = subprocess.Popen([sys.executable, "-m", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    procs.append(proc)
    return _ready_line(proc)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def bench(tmp: Path, quick: bool, workers: int) -> dict[str, Any]:
    script = tmp / "script.json"
    script.write_text(json.dumps({"responses": [{"text": "ok"}]}))
    with children() as procs:
        b = spawn(procs, "broker", "--frontend", f"ipc://{tmp}/front",
                  "--backend", f"ipc://{tmp}/back")
        llm = spawn(procs, "sandbox_worker.fakellm", "--script", str(script), "--port", "0")
        for _ in range(workers):
            spawn(procs, "sandbox_worker", "--broker", b["backend"], "--services", "model",
                  "--capacity", "256", "--log-level", "WARNING")
        route = ModelRoute(name="main", provider="openai-responses", model="scripted",
                           base_url=llm["url"], max_retries=0)
        n_lat = 30 if quick else 100
        n_par = 200 if quick else 1000
        store = await Store.open(tmp / "bench.sqlite3")
        try:
            async with BrokerClient(b["frontend"]) as client:
                raw = await _raw(client, route, n_lat, n_par)
                manager = SessionManager(store=store, broker=client,
                                         config=EngineConfig(routes={"main": route}))
                async with asyncio.TaskGroup() as tg:
                    task = tg.create_task(manager.run())
                    await manager.started()
                    try:
                        eng = await _engine(manager, tmp, n_lat, n_par)
                        eng["idle_session_kib"] = await _idle_memory(manager, tmp,
                                                                     100 if quick else 500)
                    finally:
                        task.cancel()
        finally:
            await store.close()
    return {"raw": raw, "engine": eng, "workers": workers, "turns_latency": n_lat,
            "sessions_in_flight": n_par}


async def _raw(client: BrokerClient, route: ModelRoute, n_lat: int,
               n_par: int) -> dict[str, Any]:
    body = pack({"op": "respond", "route": route, "instructions": "bench",
                 "items": [{"type": "message", "role": "user",
                            "content": [{"type": "input_text", "text": "hi"}]}],
                 "tools": [], "stream": True, "session_id": "bench"})

    async def one() -> float:
        started = time.monotonic()
        call = client.start("model", body, timeout_s=30)
        async for _ in call:
            pass
        unpack(await call.result())
        return time.monotonic() - started

    for _ in range(5):
        await one()
    lat = [await one() for _ in range(n_lat)]
    started = time.monotonic()
    await asyncio.gather(*(one() for _ in range(n_par)))
    wall = time.monotonic() - started
    return {"p50_ms": round(statistics.median(lat) * 1000, 2),
            "p99_ms": round(pct(lat, 0.99) * 1000, 2),
            "per_s": round(n_par / wall, 1)}


async def _turn(manager: SessionManager, sid: SessionId) -> float:
    last = (await manager.describe(sid))["last_event_sequence"]
    it = manager.subscribe(sid, after_sequence=last)
    started = time.monotonic()
    sub = await manager.submit(sid, {"type": "user_input", "text": "hi"})
    async with asyncio.timeout(60):
        async for e in it:
            if e.submission_id == sub and e.type in ("turn_complete", "turn_aborted"):
                break
    await it.aclose()  # type: ignore[attr-defined]
    return time.monotonic() - started


async def _engine(manager: SessionManager, tmp: Path, n_lat: int,
                  n_par: int) -> dict[str, Any]:
    ws = str(tmp)
    lat = []
    for _ in range(n_lat + 5):
        sid = await manager.create_session(SessionSpec(workspace=ws))
        lat.append(await _turn(manager, sid))
    lat = lat[5:]
    sids = [await manager.create_session(SessionSpec(workspace=ws)) for _ in range(n_par)]
    started = time.monotonic()
    await asyncio.gather(*(_turn(manager, s) for s in sids))
    wall = time.monotonic() - started
    return {"p50_ms": round(statistics.median(lat) * 1000, 2),
            "p99_ms": round(pct(lat, 0.99) * 1000, 2),
            "per_s": round(n_par / wall, 1)}


async def _idle_memory(manager: SessionManager, tmp: Path, n: int) -> float:
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(n):
            await manager.create_session(SessionSpec(workspace=str(tmp)))
        drivers = [s.driver for s in manager.sessions.values() if s.driver is not None]
        if drivers:
            await asyncio.wait(drivers, timeout=60)
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    diff = sum(s.size_diff for s in after.compare_to(before, "filename"))
    return round(diff / n / 1024, 2)


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg": [round(x, 2) for x in os.getloadavg()]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m supervisor.engine.bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a reduced run, under 60 s")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object and write bench-results/sessions.json")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="corral-bench-", dir="/tmp") as tmp:
        results = asyncio.run(bench(Path(tmp), args.quick, args.workers))
    results["seconds"] = round(time.monotonic() - started, 1)
    raw, eng = results["raw"], results["engine"]
    ratios = {"turn_p50_vs_raw_call": round(eng["p50_ms"] / raw["p50_ms"], 3),
              "turn_p99_vs_raw_call": round(eng["p99_ms"] / raw["p99_ms"], 3),
              "turns_per_s_vs_raw_calls": round(eng["per_s"] / raw["per_s"], 3)}
    if args.json:
        doc = {"name": "sessions", "machine": machine(), "results": results, "ratios": ratios}
        Path("bench-results").mkdir(exist_ok=True)
        Path("bench-results/sessions.json").write_text(json.dumps(doc, indent=2) + "\n")
        print(json.dumps(doc))
    else:
        print(f"{'path':<10}{'p50 ms':>10}{'p99 ms':>10}{'per s':>10}")
        for name in ("raw", "engine"):
            r = results[name]
            print(f"{name:<10}{r['p50_ms']:>10.2f}{r['p99_ms']:>10.2f}{r['per_s']:>10.1f}")
        print(f"idle session: {eng['idle_session_kib']} KiB")
        for k, v in ratios.items():
            print(f"{k:<28}{v:>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
