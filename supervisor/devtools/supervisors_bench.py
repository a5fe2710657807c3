"""Two supervisors against one on PostgreSQL: ``python -m supervisor.devtools.supervisors_bench
[--sessions N] [--turns M] [--supervisor-quota CORES] [--json]`` (also ``scripts/bench
supervisors`` and ``scripts/bench sessions --two-supervisors``).

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
average before and after (the machine may be shared). ``cpu_s``, ``cpu_ms_per_turn``
and ``cores_busy`` span the whole phase (the creation too) over the clock's wall time;
``clock`` has the same over the clock alone, and ``host_cores_busy`` (every process of
the host, ``/proc/stat``).

On a 2-core host the whole farm is the bound, so the ratio above says little about the
supervisors. ``two_supervisors_vs_one_supervisor_bound`` runs both phases again (same
farm, same pinning) with each supervisor in its own cgroup limited to
``--supervisor-quota`` of a core (``cpuquota``) from the clock's start (the sessions
are created before, unlimited: at 0.25 of a core 1,000 creations outran the client's
300 s call timeout): a farm whose supervisors are the bound
and whose other processes have room, as with the workers on other hosts. Per
supervisor it reports what the kernel shows over the clock: its CPU over wall against
the quota the group holds, and ``cpu.stat``'s periods, throttled periods and throttled
time. A phase in which a supervisor was never throttled or used < 80% of its quota, or
the host had >= 90% of its cores busy, was not supervisor-bound: ``not_bound`` says so,
and its ratio is then left out of the reported ratios.

Invariants: every child is started in its own session and killed and reaped by pid on
exit (``sessions_bench.children``; PostgreSQL by ``PgServer.stop``); every wait has a
deadline; a turn that aborts fails the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from supervisor.client import SupervisorClient, SupervisorError
from supervisor.devtools import cpuquota
from supervisor.devtools.pgserver import PgServer
from supervisor.devtools.sessions_bench import (
    READY_TIMEOUT_S,
    REPO,
    BenchFailed,
    children,
    machine,
    read_json_line,
    start_farm,
    write_script,
)

PHASE_TIMEOUT_S = 1800.0
CLIENT_CONCURRENCY = 64  # creates / submits in flight from this process
CALL_TIMEOUT_S = 300.0  # a busy supervisor answers a submit late, not never
# Each supervisor's CPU quota in the supervisor-bound phases, in cores: at ~12 ms of
# supervisor CPU and ~24 ms of the rest per turn over the clock (2026-12-02), two
# supervisors of 0.25 run ~40 turns/s and the farm keeps ~1.5 of the 2 cores busy.
SUPERVISOR_QUOTA = 0.25
BOUND_SHARE = 0.8  # a supervisor that used less of its quota was not bound by it
HOST_ROOM = 0.9  # a host busier than this share of its cores had no room for the rest


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
                 turns: int, lags: dict[str, float],
                 mark: Callable[[], None]) -> tuple[float, float]:
    """Create the sessions (outside the clock), submit every turn's input, wait for
    every ``turn_complete``: (the creation's wall time, the wall time from the first
    submit). ``lags``: each supervisor's largest event-loop lag seen (its ``status``,
    asked every 2 s meanwhile). ``mark`` is called as the clock starts and stops."""
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
        return created_s, await _timed(url, made, submit, sessions, turns, mark)
    finally:
        for w in watchers:
            w.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        for c in clients:
            await c.__aexit__(None, None, None)


async def _timed(url: str, made: list[tuple[SupervisorClient, str]], submit: Any,
                 sessions: int, turns: int, mark: Callable[[], None]) -> float:
    """Submit every turn's input; the wall time until every turn completed."""
    import psycopg

    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as db:
        mark()
        started = time.monotonic()
        await asyncio.gather(*(submit(c, sid, t) for t in range(turns) for c, sid in made))
        want = sessions * turns
        while True:
            done = await _count(db, "turn_complete")
            if done >= want:
                wall = time.monotonic() - started
                mark()
                return wall
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


def _machine_busy() -> float:
    """CPU seconds every process of the host has used (``/proc/stat``)."""
    t = psutil.cpu_times()
    return float(sum(t) - t.idle - getattr(t, "iowait", 0.0))


def _phase(pg: PgServer, tmp: Path, farm: dict[str, Any], roles: dict[str, list[int]],
           k: int, sessions: int, turns: int, quota: float | None = None) -> dict[str, Any]:
    """One phase on ``k`` supervisors; with ``quota``, each runs in its own cgroup
    limited to ``quota`` of a core (``cpuquota``) from the clock's start, removed
    after the processes."""
    url = pg.new_database()
    tag = f"phase{k}{'-quota' if quota else ''}"
    sups: list[subprocess.Popen[bytes]] = []
    with contextlib.ExitStack() as stack:
        groups = [stack.enter_context(cpuquota.quota(f"{tag}-sv{i + 1}", quota))
                  for i in range(k)] if quota else []
        with children() as procs:
            endpoints = []
            for i in range(k):
                home = tmp / f"{tag}-sv{i + 1}"
                _home(home, url, farm["script"])
                endpoint = f"ipc://{tmp}/{tag}-sv{i + 1}.sock"
                sups.append(_supervisor(procs, home, farm["broker"], farm["llm"],
                                        endpoint, f"bench-sv{i + 1}", i))
                endpoints.append(endpoint)
            assert pg.pid is not None
            meter = Meter({**roles, **{f"supervisor{i + 1}": [p.pid]
                                       for i, p in enumerate(sups)}}, pg.pid)
            marks: list[tuple[dict[str, float], float, list[dict[str, float]]]] = []

            def mark() -> None:  # the clock's start and end: CPU, host CPU, cpu.stat
                if not marks:  # the quota from the clock's start (the creation is free)
                    for i, g in enumerate(groups):
                        g.add(sups[i].pid)
                marks.append((meter.sample(), _machine_busy(), [g.stat() for g in groups]))

            load_before = [round(x, 2) for x in os.getloadavg()]
            before = meter.sample()
            lags: dict[str, float] = {}
            created_s, wall = asyncio.run(_drive(url, endpoints, farm["ws"], sessions,
                                                 turns, lags, mark))
            after = meter.sample()
            load_after = [round(x, 2) for x in os.getloadavg()]
            quota_read = [g.quota_read() for g in groups]
            for p in sups:
                os.kill(p.pid, signal.SIGTERM)
    n = sessions * turns
    cpu = {role: round(after[role] - before[role], 2) for role in before}
    out = {"supervisors": k, "sessions": sessions, "turns_each": turns,
           "create_s": round(created_s, 2), "wall_s": round(wall, 2),
           "turns_per_s": round(n / wall, 2),
           "cpu_s": cpu, "cpu_ms_per_turn": {r: round(v / n * 1000, 2) for r, v in cpu.items()},
           "cores_busy": round(sum(cpu.values()) / wall, 2), "loop_lag_max_s": lags,
           "loadavg_before": load_before, "loadavg_after": load_after}
    (c0, m0, s0), (c1, m1, s1) = marks
    clock = {role: c1[role] - c0[role] for role in c0}
    out["clock"] = {  # the same figures over the clock alone (without the creation)
        "cpu_ms_per_turn": {r: round(v / n * 1000, 2) for r, v in clock.items()},
        "cores_busy": round(sum(clock.values()) / wall, 2),
        "host_cores_busy": round((m1 - m0) / wall, 2)}
    if quota:
        out["quota"] = {f"supervisor{i + 1}": {
            "quota_cores": round(quota_read[i], 3),
            "cpu_over_wall": round(clock[f"supervisor{i + 1}"] / wall, 3),
            "nr_periods": int(s1[i]["nr_periods"] - s0[i]["nr_periods"]),
            "nr_throttled": int(s1[i]["nr_throttled"] - s0[i]["nr_throttled"]),
            "throttled_s": round(s1[i]["throttled_s"] - s0[i]["throttled_s"], 2)}
            for i in range(k)}
    return out


def not_bound(phase: dict[str, Any], cores: int) -> list[str]:
    """Why a quota'd phase was not bound by its supervisors' quota (empty: it was):
    each supervisor must have been throttled and have used >= 80% of its quota over
    the clock, and the host must have had room (< 90% of its cores busy)."""
    why = []
    for name, q in phase["quota"].items():
        if q["nr_throttled"] == 0:
            why.append(f"{name} was never throttled")
        if q["cpu_over_wall"] < BOUND_SHARE * q["quota_cores"]:
            why.append(f"{name} used {q['cpu_over_wall']} of a core, under "
                       f"{BOUND_SHARE:.0%} of its quota {q['quota_cores']}")
    if (busy := phase["clock"]["host_cores_busy"]) >= HOST_ROOM * cores:
        why.append(f"the host's cores were saturated ({busy} of {cores} busy)")
    return [f"{phase['supervisors']} supervisor(s): {w}" for w in why]


def run(sessions: int = 1000, turns: int = 2, workers: int = 2, capacity: int = 32,
        quota: float = SUPERVISOR_QUOTA) -> dict[str, Any]:
    """The phases; returns ``{"one", "two", "ratio", "cores", "supervisor_bound"}``
    (``supervisor_bound``: the quota'd phases, or why they could not be made)."""
    bound: dict[str, Any] = {"quota_cores": quota}
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
                try:
                    if not quota:
                        raise cpuquota.QuotaUnavailable("--supervisor-quota 0")
                    cpuquota.controller()
                    bound["one"] = _phase(pg, tmp, farm, roles, 1, sessions, turns, quota)
                    bound["two"] = _phase(pg, tmp, farm, roles, 2, sessions, turns, quota)
                except cpuquota.QuotaUnavailable as e:
                    bound["unavailable"] = str(e)
                except (BenchFailed, SupervisorError) as e:  # keep the phases above
                    bound["unavailable"] = f"a quota'd phase failed: {e}"
    finally:
        pg.stop()
    cores = os.cpu_count() or 1
    if "unavailable" not in bound:
        bound["ratio"] = round(bound["two"]["turns_per_s"] / bound["one"]["turns_per_s"], 3)
        bound["not_bound"] = not_bound(bound["one"], cores) + not_bound(bound["two"], cores)
    return {"one": one, "two": two, "cores": cores,
            "ratio": round(two["turns_per_s"] / one["turns_per_s"], 3),
            "supervisor_bound": bound}


def ratios(r: dict[str, Any]) -> dict[str, float]:
    """The ratios to report: the supervisor-bound one only when both phases were."""
    out = {"two_supervisors_vs_one": r["ratio"]}
    bound = r["supervisor_bound"]
    if "ratio" in bound and not bound["not_bound"]:
        out["two_supervisors_vs_one_supervisor_bound"] = bound["ratio"]
    return out


ROW = "{:<14} {:>3} {:>8} {:>10} {:>10} {:>11} {:>38} {:>6}"


def _row(label: str, p: dict[str, Any], ratio: Any = "") -> str:
    c = p["clock"]
    sup = " + ".join(str(v) for k, v in c["cpu_ms_per_turn"].items() if k.startswith("super"))
    quota = " + ".join(f"{q['cpu_over_wall']}/{q['quota_cores']} ({q['nr_throttled']}/"
                       f"{q['nr_periods']})" for q in p.get("quota", {}).values()) or "-"
    return ROW.format(label, p["supervisors"], p["turns_per_s"], c["cores_busy"],
                      c["host_cores_busy"], sup, quota, ratio)


def _detail(p: dict[str, Any]) -> str:
    shares = ", ".join(f"{k} {v}" for k, v in p["clock"]["cpu_ms_per_turn"].items())
    kind = "sv-bound" if "quota" in p else "machine-bound"
    return (f"  {kind} {p['supervisors']}: cpu ms/turn over the clock: {shares}; loop lag "
            f"max {p['loop_lag_max_s']}; load {p['loadavg_before']} -> {p['loadavg_after']}")


def describe(r: dict[str, Any]) -> str:
    """A table of the phases (over the clock), then each phase's CPU per role."""
    bound = r["supervisor_bound"]
    lines = [f"two_supervisors_vs_one: {r['one']['sessions']} sessions x "
             f"{r['one']['turns_each']} turns on PostgreSQL, {r['cores']} cores, each "
             "supervisor pinned to its own core",
             ROW.format("phase", "svs", "turns/s", "farm cores", "host cores", "sv ms/turn",
                        "sv cpu/quota (thr/per)", "ratio"),
             _row("machine-bound", r["one"]), _row("machine-bound", r["two"], r["ratio"])]
    phases = [r["one"], r["two"]]
    if "unavailable" in bound:
        lines.append(f"supervisor-bound: not measured: {bound['unavailable']}")
    else:
        label = f"sv-bound {bound['quota_cores']}"
        lines += [_row(label, bound["one"]), _row(label, bound["two"], bound["ratio"])]
        phases += [bound["one"], bound["two"]]
        lines.append("two_supervisors_vs_one_supervisor_bound: " + (
            f"{bound['ratio']} (each supervisor's quota was its bound; the host had room)"
            if not bound["not_bound"] else
            f"{bound['ratio']} is NOT a supervisor-bound ratio: " + "; ".join(
                bound["not_bound"])))
    return "\n".join([*lines, *(_detail(p) for p in phases)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m supervisor.devtools.supervisors_bench",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=0, help="sessions per phase (1000)")
    p.add_argument("--quick", action="store_true", help="100 sessions per phase")
    p.add_argument("--turns", type=int, default=2, help="turns per session")
    p.add_argument("--workers", type=int, default=2, help="sandbox workers")
    p.add_argument("--capacity", type=int, default=32, help="calls per worker")
    p.add_argument("--supervisor-quota", type=float, default=SUPERVISOR_QUOTA, metavar="CORES",
                   help="each supervisor's CPU quota in the supervisor-bound phases "
                        f"(default {SUPERVISOR_QUOTA}; 0: skip them)")
    p.add_argument("--json", action="store_true", help="print one JSON object; it is "
                   "also written to bench-results/supervisors.json")
    ns = p.parse_args(argv)
    if not 0.0 <= ns.supervisor_quota <= (os.cpu_count() or 1):
        p.error(f"--supervisor-quota {ns.supervisor_quota}: between 0 and the host's cores")
    sessions = ns.sessions or (100 if ns.quick else 1000)
    result = run(sessions, ns.turns, ns.workers, ns.capacity, ns.supervisor_quota)
    if ns.json:
        doc = {"name": "supervisors", "machine": machine(),
               "results": {"two_supervisors_vs_one": result}, "ratios": ratios(result)}
        (REPO / "bench-results").mkdir(exist_ok=True)
        (REPO / "bench-results" / "supervisors.json").write_text(json.dumps(doc, indent=2)
                                                                  + "\n")
        print(json.dumps(doc))
    else:
        print(describe(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
