"""``corral chaos``: a farm doing real sandboxed work under a seeded fault
schedule, then a check of every invariant (``invariants.py``).

The run: write a config and a workload script into HOME; start the farm
in this process (the same supervision tree ``corral up`` uses); start the
sessions, each driven turn after turn by its own task and watched by an event
collector that records what a client sees live, with receive times; inject
the scheduled faults; when the fault phase ends, let every session finish,
then run one more turn per session (it must complete: nothing is wedged);
stop the farm; open the store and check.

Faults are fired at real targets by ``targets.Injector`` (worker faults by
what the worker is doing, from the broker's STATUS); a fault with no target
in the wanted state is recorded as skipped. Recovery is measured per fault,
for the sessions it really affected (``recovery.py``), from the fault to
their next progress event.

Invariants:
- Every wait has a deadline; a session that does not finish a turn within
  ``turn_deadline_s`` is reported (``not_wedged``), never waited on forever.
- The same seed gives the same fault schedule and the same workload script.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from broker.client import BrokerClient
from broker.errors import BrokerError
from supervisor.chaos import invariants as inv
from supervisor.chaos import recovery
from supervisor.chaos.schedule import FRAME_FAULTS, Fault, make_schedule, parse_faults
from supervisor.chaos.targets import Injector
from supervisor.chaos.workload import count_markers, write_script
from supervisor.client import SupervisorClient, SupervisorError
from supervisor.farm.root import Farm
from supervisor.store import slowdisk
from supervisor.store.records import SessionId

log = logging.getLogger(__name__)


@dataclass
class ChaosOptions:
    seed: int = 1
    duration_s: float = 60.0
    sessions: int = 8
    faults: str = "all"
    workers: int = 3
    turns: int = 1000  # upper bound; sessions keep working until the fault phase ends
    steps: int = 3
    home: Path | None = None
    turn_deadline_s: float = 120.0
    # Overrides for the demo: a fixed schedule and a workload script builder.
    schedule: list[Fault] | None = None
    script: dict[str, Any] | None = None
    max_turns_per_session: int | None = None
    # A real provider instead of the scripted one (``PROVIDER:MODEL`` route
    # fields); then the workload is not scripted, so the marker checks are off.
    route: dict[str, Any] | None = None
    prompt: str = "do the next step ({n})"


@dataclass
class SessionRun:
    session_id: str
    workspace: Path
    submissions: list[str] = field(default_factory=list)
    live: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    turns_done: int = 0
    final_ok: bool = False
    busy: bool = False


@dataclass
class Report:
    seed: int
    schedule: list[Fault]
    injected: list[dict[str, Any]] = field(default_factory=list)
    sessions: list[SessionRun] = field(default_factory=list)
    violations: list[inv.Violation] = field(default_factory=list)
    exports: int = 0
    recovery: dict[str, list[float]] = field(default_factory=dict)
    unrecovered: dict[str, int] = field(default_factory=dict)
    continuous: dict[str, Any] = field(default_factory=dict)
    checks: list[str] = field(default_factory=list)
    repeated_requests: int = 0  # markers the model asked for twice (not a violation)
    elapsed_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        rec = {}
        for group, times in sorted(self.recovery.items()):
            rec[group] = {**recovery.summarize(times),
                          "unrecovered": self.unrecovered.get(group, 0)}
        tool_calls = sum(1 for s in self.sessions for _, e in s.live
                         if e.get("type") == "tool_call_end")
        return {
            "seed": self.seed,
            "checks": self.checks,
            "violations": [v.as_dict() for v in self.violations],
            "counts": {
                "sessions": len(self.sessions),
                "turns": sum(len(s.submissions) for s in self.sessions),
                "tool_calls": tool_calls,
                "faults_scheduled": len(self.schedule),
                "faults_injected": sum(1 for f in self.injected if "skipped" not in f),
                "faults_skipped": sum(1 for f in self.injected if "skipped" in f),
                "exports_verified": self.exports,
                "sessions_final_turn_ok": sum(s.final_ok for s in self.sessions),
                "repeated_requests": self.repeated_requests,
            },
            "faults": self.injected,
            "continuous_faults": self.continuous,
            "recovery": rec,
            "elapsed_s": round(self.elapsed_s, 1),
        }


STORE_SLOW_DELAY_S = 0.2  # per write transaction while a store_slow fault is on

CONFIG = """\
[farm]
heartbeat_interval_s = 0.25
liveness = 4

[sandbox]
tier_min = "{tier_min}"

[session]
default_route = "chaos"
approval = "allow"
turn_timeout_s = 300
# Short request deadlines: a frame the broker drops on purpose must end its
# call within the run (the caller's deadline), not after the 5-10 min defaults.
model_call_budget_s = 10
tool_call_budget_s = 10

[routes.chaos]
{route}

[[export.sinks]]
type = "directory"
path = "exports"
"""


class Harness:
    def __init__(self, opts: ChaosOptions) -> None:
        self.opts = opts
        self.kinds = parse_faults(opts.faults)
        self.home = opts.home or Path(tempfile.mkdtemp(prefix="corral-chaos-"))
        self.schedule = (opts.schedule if opts.schedule is not None
                         else make_schedule(opts.seed, opts.duration_s, self.kinds))
        self.report = Report(opts.seed, self.schedule)
        self.pids: set[int] = set()
        self.farm: Farm | None = None
        self.faults_over = asyncio.Event()
        self.marks: list[tuple[int, recovery.FaultMark]] = []  # (index in injected, mark)
        self.slow_flag = self.home / "chaos-slow-disk.flag"

    # -- set-up -------------------------------------------------------------

    def prepare(self, tier_min: str = "T2") -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        script = self.home / "workload.json"
        if self.opts.script is not None:
            script.write_text(json.dumps(self.opts.script))
        else:
            write_script(script, self.opts.turns, self.opts.steps, self.opts.seed, self.kinds)
        if self.opts.route is not None:
            route = "\n".join(f"{k} = {json.dumps(v)}" for k, v in self.opts.route.items())
        else:
            route = (f"script = {json.dumps(str(script))}\n"
                     "read_timeout_s = 3.0\nconnect_timeout_s = 2.0")
        (self.home / "corral.toml").write_text(CONFIG.format(tier_min=tier_min, route=route))

    @property
    def marker_checks(self) -> bool:
        """Marker-based checks need the scripted workload (a real model improvises)."""
        return self.opts.route is None

    def _track_pids(self) -> None:
        if self.farm is not None:
            for c in self.farm.tree.children.values():
                if c.pid:
                    self.pids.add(c.pid)

    # -- the run ------------------------------------------------------------

    async def run(self) -> Report:
        started = time.monotonic()
        self.prepare()
        frame = [k for k in self.kinds if k in FRAME_FAULTS]
        env = None
        if "store_slow" in self.kinds:
            env = {slowdisk.DELAY_ENV: str(STORE_SLOW_DELAY_S),
                   slowdisk.FLAG_ENV: str(self.slow_flag)}
        self.farm = Farm(self.home, workers=self.opts.workers,
                         broker_faults=",".join(frame) or None,
                         broker_faults_seed=self.opts.seed, supervisor_env=env,
                         log_level="INFO",
                         on_change=self._track_pids)  # every pid the farm ever ran
        ready = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            farm_task = tg.create_task(self.farm.tree.run(on_ready=ready.set))
            async with asyncio.timeout(120):
                await ready.wait()
            self._track_pids()
            endpoint = self.farm.paths.supervisor_endpoint
            async with SupervisorClient(endpoint, timeout_s=15) as sv, \
                    BrokerClient(self.farm.paths.broker_frontend) as broker:
                injector = Injector(self.farm, broker, self.slow_flag)
                runs = [await self._create(sv, i) for i in range(self.opts.sessions)]
                self.report.sessions = runs
                async with asyncio.TaskGroup() as work:
                    collectors = [work.create_task(self._collect(sv, r)) for r in runs]
                    drivers = [work.create_task(self._drive(sv, r)) for r in runs]
                    await self._inject(injector, t0=time.monotonic())
                    self.faults_over.set()
                    if frame:
                        self.report.continuous["frame"] = await _frame_counts(broker)
                    await asyncio.gather(*drivers)
                    # Not wedged: one more turn each, all at once, which must complete.
                    finals = await asyncio.gather(*(self._turn(sv, r) for r in runs))
                    for r, ok in zip(runs, finals, strict=True):
                        r.final_ok = ok
                    await asyncio.sleep(0.5)  # let collectors see the last durable events
                    for c in collectors:
                        c.cancel()
            farm_task.cancel()
        await asyncio.sleep(0)
        self._recovery()
        await self._check()
        self.report.elapsed_s = time.monotonic() - started
        return self.report

    async def _create(self, sv: SupervisorClient, i: int) -> SessionRun:
        # Beside the home, never in it: a workspace may not overlap the farm's home.
        ws = self.home.with_name(f"{self.home.name}-ws") / f"s{i}"
        ws.mkdir(parents=True, exist_ok=True)
        # The farm set this process's umask to 077 (its home is private).
        os.chmod(ws.parent, 0o755)
        os.chmod(ws, 0o755)
        sid = await _retry(lambda: sv.create_session(workspace=str(ws)))
        return SessionRun(str(sid), ws)

    async def _collect(self, sv: SupervisorClient, run: SessionRun) -> None:
        async for event in sv.events(run.session_id, reconnect_timeout_s=600):
            run.live.append((time.monotonic(), event))

    async def _turn(self, sv: SupervisorClient, run: SessionRun) -> bool:
        """Submit one turn and wait (with a deadline) for its terminal event."""
        seen = len(run.live)
        run.busy = True
        try:
            sub = await _retry(lambda: sv.submit(run.session_id, {
                "type": "user_input", "text": self.opts.prompt.format(n=len(run.submissions))}))
            run.submissions.append(str(sub))
            log.debug("session %s: submitted %s", run.session_id, sub)
            deadline = time.monotonic() + self.opts.turn_deadline_s
            while time.monotonic() < deadline:
                for _, e in run.live[seen:]:
                    if e.get("submission_id") == sub and e.get("type") in (
                            "turn_complete", "turn_aborted"):
                        run.turns_done += 1
                        log.debug("session %s: %s ended %s", run.session_id, sub, e["type"])
                        return bool(e["type"] == "turn_complete")
                await asyncio.sleep(0.05)
            return False
        finally:
            run.busy = False

    async def _drive(self, sv: SupervisorClient, run: SessionRun) -> None:
        limit = self.opts.max_turns_per_session or self.opts.turns - 2
        while not self.faults_over.is_set() and run.turns_done < limit:
            if not await self._turn(sv, run) and not self.faults_over.is_set():
                await asyncio.sleep(0.2)

    # -- faults -------------------------------------------------------------

    async def _inject(self, injector: Injector, t0: float) -> None:
        for fault in self.schedule:
            wait = t0 + fault.at_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            index = len(self.report.injected)
            at_s = round(time.monotonic() - t0, 3)

            def mark(service: str | None, kind: str = fault.kind, index: int = index) -> None:
                group = "worker" if kind.startswith("worker_") else kind.split("_")[0]
                marks = {r.session_id: len(r.live) for r in self.report.sessions}
                self.marks.append((index, recovery.FaultMark(group, time.monotonic(),
                                                             service, marks)))

            record = await injector.fire(fault, mark)
            record["at_s"] = at_s
            self.report.injected.append(record)
            log.info("chaos: %s", record)
        rest = t0 + self.opts.duration_s - time.monotonic()
        if rest > 0:
            await asyncio.sleep(rest)

    def _recovery(self) -> None:
        lives = {r.session_id: r.live for r in self.report.sessions}
        for index, fm in self.marks:
            hit = recovery.affected(fm, lives)
            record = self.report.injected[index]
            record["affected"] = {sid: None if t is None else round(t, 3)
                                  for sid, t in sorted(hit.items())}
            times = [t for t in hit.values() if t is not None]
            self.report.recovery.setdefault(fm.group, []).extend(times)
            missing = sum(1 for t in hit.values() if t is None)
            if missing:
                self.report.unrecovered[fm.group] = (
                    self.report.unrecovered.get(fm.group, 0) + missing)

    # -- checking -----------------------------------------------------------

    async def _check(self) -> None:
        from supervisor.store import Store

        v = self.report.violations
        self.report.checks = [c for c in inv.ALL_CHECKS
                              if self.marker_checks or c not in inv.MARKER_CHECKS]
        # off the loop: a process still listed in a cgroup gets seconds to die
        v.extend(await asyncio.to_thread(inv.no_orphans, set(self.pids)))
        store = await Store.open(self.home / "corral.db")
        try:
            for r in self.report.sessions:
                replay = [_wire(e) for e in await store.replay_events(SessionId(r.session_id))]
                live = [e for _, e in r.live]
                v.extend(inv.turn_ends_once(r.session_id, r.submissions, replay))
                if not r.final_ok:
                    v.append(inv.Violation("not_wedged", r.session_id, None,
                                           "the turn after the faults did not complete"))
                loaded = await store.load(SessionId(r.session_id))
                if loaded is not None:
                    v.extend(inv.one_output_per_call(r.session_id, loaded.context))
                if self.marker_checks:
                    v.extend(inv.effects(r.session_id, replay, count_markers(r.workspace)))
                    self.report.repeated_requests += inv.repeated_requests(replay)
                v.extend(inv.replay_equals_live(r.session_id, live, replay))
        finally:
            await store.close()
        n, bad = inv.exports_verify(self.home / "exports")
        self.report.exports = n
        v.extend(bad)


def _wire(e: Any) -> dict[str, Any]:
    return {"sequence": e.sequence, "type": e.type, "payload": e.payload,
            "submission_id": e.submission_id}


async def _frame_counts(broker: BrokerClient) -> dict[str, Any]:
    """The broker's frame-fault counters (since its last start: a broker kill resets them)."""
    try:
        status = await broker.status(timeout_s=2.0)
    except (BrokerError, TimeoutError) as exc:  # a report field, not a failure of the run
        return {"error": str(exc)}
    counters = status.get("counters") or {}
    return {"since_last_broker_start": counters.get("faults", {}), "rate": 0.02}


async def _retry(make: Any, *, attempts: int = 60) -> Any:
    for i in range(attempts):
        try:
            return await make()
        except SupervisorError as exc:
            if exc.kind != "unavailable" or i == attempts - 1:
                raise
            await asyncio.sleep(0.5)
    raise AssertionError("unreachable")


def render(report: dict[str, Any]) -> str:
    lines = [f"chaos seed {report['seed']}: {len(report['violations'])} violation(s), "
             f"{report['elapsed_s']}s"]
    for k, n in report["counts"].items():
        lines.append(f"  {k:<24} {n}")
    for group, r in report["recovery"].items():
        lines.append(f"  recovery {group:<15} n={r['count']} p50={r['p50_s']}s p99={r['p99_s']}s")
    for v in report["violations"][:10]:
        lines.append(f"  VIOLATION {v['invariant']} session={v['session_id']} "
                     f"seq={v['sequence']}: {v['detail']}")
    return "\n".join(lines)


def main(ns: Any) -> int:
    opts = ChaosOptions(seed=ns.seed, duration_s=ns.duration, sessions=ns.sessions,
                        faults=ns.faults, workers=getattr(ns, "workers", 3),
                        home=ns.home if ns.home != Path.home() / ".corral" else None)
    try:
        report = asyncio.run(Harness(opts).run()).as_dict()
    except ValueError as exc:
        print(f"corral: {exc}")
        return 2
    print(json.dumps(report, sort_keys=True) if ns.json else render(report))
    if report["violations"]:
        first = report["violations"][0]
        print(f"seed {report['seed']}: first violation: {first['invariant']} in session "
              f"{first['session_id']} at sequence {first['sequence']}: {first['detail']}")
        return 1
    return 0
