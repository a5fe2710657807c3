"""Two supervisors against one on PostgreSQL: ``python -m supervisor.devtools.supervisors_bench
[--sessions N] [--turns M] [--json]`` (also ``scripts/bench sessions --two-supervisors``).

``two_supervisors_vs_one``: turns/s of N sessions x M turns on two supervisor processes
sharing one PostgreSQL store, over the same on one supervisor, in the same run, on the
same farm (issue 19: 1,000 sessions, target >= 1.4 on a 2-core machine). Each
supervisor is pinned to its own core (``taskset -c 0`` / ``-c 1``); the broker, the
workers with their sandboxed tools, the scripted provider and PostgreSQL float over
both cores, as they would on a 2-core host.

Set-up, all real processes: a throwaway durable PostgreSQL cluster (``pgserver``,
fsync on), one broker, ``--workers`` sandbox workers, the scripted provider on loopback
(the sessions benchmark's turn: one sandboxed ``shell`` call, then the answer), and per
phase a fresh database with 1 then 2 ``python -m supervisor`` processes. Sessions are
created half on each supervisor (``placed``: kept there), outside the clock; the clock
runs from the first submitted input until PostgreSQL holds N x M ``turn_complete``
events (polled from PostgreSQL directly, so the bench's client is idle meanwhile).

Where the limit is: the CPU time of every process of the phase (each supervisor,
PostgreSQL's server processes, the broker, the workers, their sandboxed tools, the
provider, this process), per turn and as a share of the machine's cores, with the load
average before and after (the machine may be shared).

Invariants: every child is started in its own session and killed and reaped by pid on
exit (``sessions_bench.children``; PostgreSQL by ``PgServer.stop``); every wait has a
deadline; a turn that aborts fails the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from supervisor.client import SupervisorClient
from supervisor.devtools.pgserver import PgServer
from supervisor.devtools.sessions_bench import (
    READY_TIMEOUT_S,
    REPO,
    BenchFailed,
    children,
    read_json_line,
    start_farm,
    write_script,
)

PHASE_TIMEOUT_S = 1800.0
CLIENT_CONCURRENCY = 64  # creates / submits in flight from this process
CALL_TIMEOUT_S = 300.0  # a busy supervisor answers a submit late, not never


def _home(home: Path, url: str, script: Path) -> None:
    home.mkdir(parents=True, exist_ok=True)
    (home / "corral.toml").write_text(
        '[session]\ndefault_route = "s"\napproval = "allow"\n'
        f'[routes.s]\nscript = "{script}"\nread_timeout_s = 60.0\n'
        f'[store]\nurl = "{url}"\n')


def _cpu(procs: list[psutil.Process], with_children: bool = False) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
        if with_children:
            total += t.children_user + t.children_system
    return total


class Meter:
    """CPU seconds of each role; PostgreSQL's server processes are read live (its
    backends come with the supervisors' connections)."""

    def __init__(self, roles: dict[str, list[int]], postmaster: int) -> None:
        self.roles = {k: [psutil.Process(p) for p in v] for k, v in roles.items()}
        self.postmaster = psutil.Process(postmaster)
        self.gone_pg = 0.0
        self._seen: dict[int, tuple[psutil.Process, float]] = {}

    def _postgres(self) -> float:
        procs = [self.postmaster, *self.postmaster.children(recursive=True)]
        now = {}
        for p in procs:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            now[p.pid] = (p, t.user + t.system)
        for pid, (_, last) in self._seen.items():  # a backend that ended: keep its last
            if pid not in now:
                self.gone_pg += last
        self._seen = now
        return float(self.gone_pg + sum(v for _, v in now.values()))

    def sample(self) -> dict[str, float]:
        out = {k: _cpu(v) for k, v in self.roles.items() if k != "workers"}
        out["workers"] = _cpu(self.roles["workers"])
        out["tools"] = sum(p.cpu_times().children_user + p.cpu_times().children_system
                           for p in self.roles["workers"])
        out["postgresql"] = self._postgres()
        out["bench"] = _cpu([psutil.Process()])
        return out


async def _count(db: Any, kind: str) -> int:
    cur = await db.execute("SELECT count(*) FROM events WHERE type = %s", (kind,))
    row = await cur.fetchone()
    return int(row[0]) if row else 0


async def _drive(url: str, endpoints: list[str], ws: Path, sessions: int,
                 turns: int, lags: dict[str, float]) -> tuple[float, float]:
    """Create the sessions (outside the clock), submit every turn's input, wait for
    every ``turn_complete``: (the creation's wall time, the wall time from the first
    submit). ``lags``: each supervisor's largest event-loop lag seen (its ``status``,
    asked every 2 s meanwhile)."""
    gate = asyncio.Semaphore(CLIENT_CONCURRENCY)
    clients = [SupervisorClient(e) for e in endpoints]

    async def create(i: int) -> tuple[SupervisorClient, str]:
        c = clients[i % len(clients)]
        async with gate:
            return c, str(await c.call("create_session", spec={"workspace": str(ws)},
                                       placed=True, timeout_s=CALL_TIMEOUT_S))

    async def submit(c: SupervisorClient, sid: str, t: int) -> None:
        async with gate:
            await c.call("submit", session_id=sid, timeout_s=CALL_TIMEOUT_S,
                         op={"type": "user_input", "text": f"turn {t}"})

    async def watch(name: str, c: SupervisorClient) -> None:
        while True:
            try:
                st = await c.call("status", timeout_s=CALL_TIMEOUT_S)
                lag = float(st["sessions"]["loop_lag_max_60s_s"])
                lags[name] = max(lags.get(name, 0.0), lag)
            except Exception:  # diagnostics only
                pass
            await asyncio.sleep(2.0)

    watchers: list[asyncio.Task[None]] = []
    try:
        for c in clients:
            await c.__aenter__()
        watchers = [asyncio.create_task(watch(f"supervisor{i + 1}", c))
                    for i, c in enumerate(clients)]
        t0 = time.monotonic()
        made = await asyncio.gather(*(create(i) for i in range(sessions)))
        created_s = time.monotonic() - t0
        return created_s, await _timed(url, made, submit, sessions, turns)
    finally:
        for w in watchers:
            w.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        for c in clients:
            await c.__aexit__(None, None, None)


async def _timed(url: str, made: list[tuple[SupervisorClient, str]], submit: Any,
                 sessions: int, turns: int) -> float:
    """Submit every turn's input; the wall time until every turn completed."""
    import psycopg

    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as db:
        started = time.monotonic()
        await asyncio.gather(*(submit(c, sid, t) for t in range(turns) for c, sid in made))
        want = sessions * turns
        while True:
            done = await _count(db, "turn_complete")
            if done >= want:
                return time.monotonic() - started
            if await _count(db, "turn_aborted"):
                raise BenchFailed("a turn aborted")
            if time.monotonic() - started > PHASE_TIMEOUT_S:
                raise BenchFailed(f"{done} of {want} turns done after "
                                  f"{PHASE_TIMEOUT_S:g} s")
            await asyncio.sleep(0.25)


def _supervisor(procs: list[subprocess.Popen[bytes]], home: Path, broker: str, llm: str,
                endpoint: str, ident: str, cpu: int) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "supervisor", "--home", str(home), "--broker", broker,
            "--listen", endpoint, "--route-url", f"s={llm}", "--supervisor-id", ident,
            "--log-level", "WARNING"]
    if (os.cpu_count() or 1) > cpu:
        argv = ["taskset", "-c", str(cpu), *argv]
    with (home / "supervisor.err").open("wb") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err,
                                start_new_session=True, cwd=REPO)
    procs.append(proc)
    line = read_json_line(proc, READY_TIMEOUT_S)
    if line.get("event") != "ready":
        raise BenchFailed(f"supervisor {ident} (pid {proc.pid}) did not report ready: {line}")
    return proc


def _phase(pg: PgServer, tmp: Path, farm: dict[str, Any], roles: dict[str, list[int]],
           k: int, sessions: int, turns: int) -> dict[str, Any]:
    url = pg.new_database()
    sups: list[subprocess.Popen[bytes]] = []
    with children() as procs:
        endpoints = []
        for i in range(k):
            home = tmp / f"phase{k}-sv{i + 1}"
            _home(home, url, farm["script"])
            endpoint = f"ipc://{tmp}/phase{k}-sv{i + 1}.sock"
            sups.append(_supervisor(procs, home, farm["broker"], farm["llm"], endpoint,
                                    f"bench-sv{i + 1}", i))
            endpoints.append(endpoint)
        assert pg.pid is not None
        meter = Meter({**roles, **{f"supervisor{i + 1}": [p.pid] for i, p in enumerate(sups)}},
                      pg.pid)
        load_before = [round(x, 2) for x in os.getloadavg()]
        before = meter.sample()
        lags: dict[str, float] = {}
        created_s, wall = asyncio.run(_drive(url, endpoints, farm["ws"], sessions, turns,
                                             lags))
        after = meter.sample()
        load_after = [round(x, 2) for x in os.getloadavg()]
        for p in sups:
            os.kill(p.pid, signal.SIGTERM)
    n = sessions * turns
    cpu = {role: round(after[role] - before[role], 2) for role in before}
    return {"supervisors": k, "sessions": sessions, "turns_each": turns,
            "create_s": round(created_s, 2), "wall_s": round(wall, 2),
            "turns_per_s": round(n / wall, 2),
            "cpu_s": cpu, "cpu_ms_per_turn": {r: round(v / n * 1000, 2) for r, v in cpu.items()},
            "cores_busy": round(sum(cpu.values()) / wall, 2), "loop_lag_max_s": lags,
            "loadavg_before": load_before, "loadavg_after": load_after}


def run(sessions: int = 1000, turns: int = 2, workers: int = 2,
        capacity: int = 32) -> dict[str, Any]:
    """Both phases; returns ``{"one", "two", "ratio", "cores"}``."""
    pg = PgServer.start(durable=True)
    try:
        with tempfile.TemporaryDirectory(prefix="corral-supervisors-", dir="/tmp") as name:
            tmp = Path(name)
            tmp.chmod(0o755)
            ws = tmp / "ws"
            ws.mkdir()
            ws.chmod(0o777)  # the sandbox uid writes here
            script = tmp / "script.json"
            write_script(script, turns + 1)
            with children() as procs:
                b, llm, roles = start_farm(procs, tmp, script, workers, capacity)
                farm = {"broker": b["frontend"], "llm": llm["url"], "ws": ws,
                        "script": script}
                one = _phase(pg, tmp, farm, roles, 1, sessions, turns)
                two = _phase(pg, tmp, farm, roles, 2, sessions, turns)
    finally:
        pg.stop()
    return {"one": one, "two": two, "cores": os.cpu_count(),
            "ratio": round(two["turns_per_s"] / one["turns_per_s"], 3)}


def describe(r: dict[str, Any]) -> str:
    lines = [f"two_supervisors_vs_one: {r['ratio']} ({r['one']['sessions']} sessions x "
             f"{r['one']['turns_each']} turns on PostgreSQL, {r['cores']} cores)"]
    for key in ("one", "two"):
        p = r[key]
        shares = ", ".join(f"{k} {v}" for k, v in p["cpu_ms_per_turn"].items())
        lines.append(f"  {p['supervisors']} supervisor(s): {p['turns_per_s']} turns/s, "
                     f"{p['cores_busy']} cores busy; cpu ms/turn: {shares}; loop lag max "
                     f"{p['loop_lag_max_s']}; load {p['loadavg_before']} -> "
                     f"{p['loadavg_after']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m supervisor.devtools.supervisors_bench",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=1000, help="sessions per phase")
    p.add_argument("--turns", type=int, default=2, help="turns per session")
    p.add_argument("--workers", type=int, default=2, help="sandbox workers")
    p.add_argument("--capacity", type=int, default=32, help="calls per worker")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    ns = p.parse_args(argv)
    result = run(ns.sessions, ns.turns, ns.workers, ns.capacity)
    print(json.dumps({"two_supervisors_vs_one": result}) if ns.json else describe(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
