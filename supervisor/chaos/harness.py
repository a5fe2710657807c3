"""``corral chaos``: a farm doing real sandboxed work under a seeded fault
schedule, then a check of every invariant (``invariants.py``).

The run: write a config and a workload script into HOME; start the farm
in this process (the same supervision tree ``corral up`` uses); start the
sessions, each driven turn after turn by its own task and watched by an event
collector that records what a client sees live, with receive times; inject
the scheduled faults; when the fault phase ends, let every session finish,
then run one more turn per session (it must complete: nothing is wedged);
stop the farm; open the store and check.

Sessions have roles (``role``): plain, compact (a small context window on
a route with the scripted provider's compaction, so compaction really runs)
and ask (approval policy ``ask``; ``_answer`` answers each request as a user
would, seeded approve/deny), so the compaction and approval-wait windows are
there for the crash points to hit.

Faults are fired at real targets by ``targets.Injector`` (worker faults by
what the worker is doing, from the broker's STATUS); a fault with no target
in the wanted state is recorded as skipped. Recovery is measured per fault,
for the sessions it really affected (``recovery.py``), from the fault to
their next progress event.

Plants (``--plant NAME``, ``broker/plants.py``): the names go into the
environment of every farm child this harness starts (never into its own),
and into that of the export check; nothing else changes. The harness, the
schedule and the invariants are the same whatever plant is on: a plant must
be found from the evidence.

Evidence gathered while the farm runs, besides what clients see live: the
process table, sampled every ``WATCH_EVERY_S`` (``evidence.ProcWatch``), and,
for every worker fault, the calls in the worker's cgroup at the instant.

Invariants:
- Every wait has a deadline; a session that does not finish a turn within
  ``turn_deadline_s`` is reported (``not_wedged``), never waited on forever.
- The same seed gives the same fault schedule and the same workload script.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import json
import logging
import os
import random
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from broker import plants
from broker.client import BrokerClient
from broker.errors import BrokerError
from supervisor import crashpoints
from supervisor.chaos import evidence, pgfarm, recovery
from supervisor.chaos import invariants as inv
from supervisor.chaos.evidence import ProcWatch
from supervisor.chaos.exportkeep import ExportKeeper
from supervisor.chaos.schedule import (
    FRAME_FAULTS,
    Fault,
    coverage_s,
    farm_shape,
    make_schedule,
    parse_faults,
    timed_kinds,
)
from supervisor.chaos.targets import Injector
from supervisor.chaos.workload import (
    ID_FILE,
    LONG_S,
    count_markers,
    make_script,
    requests_in,
)
from supervisor.client import SupervisorClient, SupervisorError
from supervisor.farm.root import Farm
from supervisor.store import slowdisk
from supervisor.store.errors import StoreError
from supervisor.store.records import SessionId
from supervisor.telemetry.labels import CHAOS_FAULTS_FILE

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
    plants: tuple[str, ...] = ()  # planted bugs (broker/plants.py), for the checker's self-test
    fault_gap_s: float = 2.5  # minimum gap between timed faults (bounded: up to twice that)
    frame_rate: float = 0.02  # share of request-traffic frames the broker mangles
    provider_rate: float = 0.15  # share of script entries with a provider fault (1st attempt)
    metrics: str | None = None  # HOST:PORT: the farm serves Prometheus /metrics there
    # The farm's shape: None = what the kinds need (a supervisor-set kind: 3 supervisors
    # on PostgreSQL; broker_kill_one: 2 brokers). Several supervisors share a PostgreSQL
    # store: ``store_url`` (an empty database) or a throwaway cluster of the run's own.
    supervisors: int | None = None
    brokers: int | None = None
    store_url: str | None = None
    lease_s: float = 2.0  # [store] lease_s of a PostgreSQL chaos farm (the minimum is 1)


@dataclass
class SessionRun:
    session_id: str
    workspace: Path
    submissions: list[str] = field(default_factory=list)
    live: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    turns_done: int = 0
    final_ok: bool = False
    busy: bool = False
    role: str = "plain"  # plain | compact (small context window) | ask (approvals answered)
    client: SupervisorClient | None = None  # the collector's client (its subscription)
    resent: int = 0  # events the supervisor sent again within one subscription
    # approval id -> what the harness answered: decision, submission ids, when
    answers: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class Report:
    seed: int
    schedule: list[Fault]
    injected: list[dict[str, Any]] = field(default_factory=list)
    sessions: list[SessionRun] = field(default_factory=list)
    violations: list[inv.Violation] = field(default_factory=list)
    exports: int = 0
    exports_seen: int = 0  # checkpoint files the keeper saw the farm write
    recovery: dict[str, list[float]] = field(default_factory=dict)
    unrecovered: dict[str, int] = field(default_factory=dict)
    continuous: dict[str, Any] = field(default_factory=dict)
    checks: list[str] = field(default_factory=list)
    repeated_requests: int = 0  # markers the model asked for twice (a violation)
    elapsed_s: float = 0.0
    recovery_by_kind: dict[str, list[float]] = field(default_factory=dict)
    killed_calls: dict[str, int] = field(default_factory=dict)
    coverage_s: float = 0.0
    duration_s: float = 0.0
    plants: tuple[str, ...] = ()
    proc_samples: int = 0
    provider_faults: dict[str, int] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)  # wall seconds per phase
    host: dict[str, Any] = field(default_factory=dict)  # cores, load, CPU the run used
    unfired: int = 0  # scheduled faults left when the fault phase ended
    farm: dict[str, Any] = field(default_factory=dict)  # supervisors, brokers, store
    owners: dict[str, list[str]] = field(default_factory=dict)  # session -> owners in turn
    retries_between_owners: int = 0  # client calls retried while a session changed hands

    def as_dict(self) -> dict[str, Any]:
        rec = {}
        for group, times in sorted(self.recovery.items()):
            rec[group] = {**recovery.summarize(times),
                          "unrecovered": self.unrecovered.get(group, 0)}
        tool_calls = sum(1 for s in self.sessions for _, e in s.live
                         if e.get("type") == "tool_call_end" and e.get("sequence", 0) > 0)
        by_kind: dict[str, dict[str, Any]] = {}
        for f in self.injected:
            k = by_kind.setdefault(f["kind"], {"injected": 0, "skipped": 0, "hit": 0})
            k["skipped" if "skipped" in f else "injected"] += 1
            k["hit"] += bool(f.get("hit")) and "skipped" not in f
        for kind, times in sorted(self.recovery_by_kind.items()):
            by_kind.setdefault(kind, {"injected": 0, "skipped": 0, "hit": 0})["recovery"] = (
                recovery.summarize(times))
        durable_seen = [e.get("type") for s in self.sessions for _, e in s.live
                        if e.get("sequence", 0) > 0]
        return {
            "seed": self.seed,
            "plants": list(self.plants),
            "duration_s": self.duration_s,
            "coverage_s": self.coverage_s,
            "checks": self.checks,
            "violations": [v.as_dict() for v in self.violations],
            "counts": {
                "sessions": len(self.sessions),
                "turns": sum(len(s.submissions) for s in self.sessions),
                "tool_calls": tool_calls,
                "faults_scheduled": len(self.schedule),
                "faults_injected": sum(1 for f in self.injected if "skipped" not in f),
                "faults_skipped": sum(1 for f in self.injected if "skipped" in f),
                "faults_not_fired": self.unfired,
                "exports_verified": self.exports,
                "exports_seen": self.exports_seen,
                "sessions_final_turn_ok": sum(s.final_ok for s in self.sessions),
                "repeated_requests": self.repeated_requests,
                "killed_calls": self.killed_calls,
                "process_table_samples": self.proc_samples,
                "compactions": durable_seen.count("context_compacted"),
                "approvals_requested": durable_seen.count("exec_approval_request"),
                "approvals_answered": sum(len(s.answers) for s in self.sessions),
                "sessions_by_role": dict(sorted(
                    (role, sum(s.role == role for s in self.sessions))
                    for role in {s.role for s in self.sessions})),
            },
            "farm": self.farm,
            "owners": {
                "sessions_with_several_owners": sum(len(set(o)) > 1
                                                    for o in self.owners.values()),
                "owner_changes": sum(max(0, len(o) - 1) for o in self.owners.values()),
                "retries_between_owners": self.retries_between_owners,
            } if self.owners else {},
            "faults_by_kind": by_kind,
            "provider_faults_in_script": self.provider_faults,
            "faults": self.injected,
            "continuous_faults": self.continuous,
            "recovery": rec,
            "elapsed_s": round(self.elapsed_s, 1),
            "phases_s": {k: round(v, 1) for k, v in self.phases.items()},
            "host": self.host,
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
# The ask sessions' approvals: the harness answers each within a second; an
# answer lost by the farm shows as a timed-out approval (approvals_kept).
approval_timeout_s = {approval_timeout_s}
turn_timeout_s = 300
# Short request deadlines: a frame the broker drops on purpose must end its
# call within the run (the caller's deadline), not after the 5-10 min defaults.
model_call_budget_s = {budget_s:g}
tool_call_budget_s = {budget_s:g}

[routes.chaos]
{route}
{compact_route}
[[export.sinks]]
type = "directory"
path = "exports"
{store}"""


LIVENESS_WINDOW_S = 0.25 * 4  # [farm] heartbeat_interval_s x liveness, above
BUDGET_S = 10.0  # [session] model_call_budget_s and tool_call_budget_s, above
LOSS_MARGIN_S = 2.0  # commit and delivery of the loss report, on a loaded 2-core host
RESUME_S = 1.5  # a restarted supervisor resumes its sessions after it is up
CLAIM_S = 0.5  # another supervisor looks for lapsed leases this often (leasing.CLAIM_PERIOD_S)
EXPORTCHECK_S = 600  # the kept exports (measured: ~3 s per 80 on a loaded host)
EXPORT_KEEP = 400  # checkpoints kept for the check, an even sample of the run's (exportkeep)
LOAD_EVERY_S = 30.0  # the 1-minute load average is sampled this often while the farm runs
EXPORT_POLL_S = 2.0  # how often the keeper looks at the sink (it keeps 5 per session)
FINAL_TRIES = 3  # turns a session may need after the faults (each must end, one complete)
RETRIES = 10  # a skipped fault is retried in the next slots (targets come and go)
ORPHAN_GRACE_S = LONG_S + 4.0  # after a call ends: the rest of a long call may still run
KILL_BOUND_S = 2.0 + 2.0  # after a cancel or a worker kill: the sandbox's TERM grace + margin
WATCH_EVERY_S = 0.5
# The faults that end calls whose processes must then be gone within KILL_BOUND_S.
KILL_KINDS = frozenset({"interrupt_tool", "worker_kill_tool", "worker_kill_model",
                        "worker_kill_idle"})
# Answers a client retries while a session changes hands (several supervisors), or
# while PostgreSQL is restarting (``store_unavailable``: retryable, docs/storage.md).
BETWEEN_OWNERS = frozenset({"unknown_session", "moved", "unavailable", "lease_lost",
                            "store_unavailable"})
# A subscription's end a client resubscribes after, with several supervisors: a session
# given up ends its subscriptions "closed" while no other supervisor holds it yet (the
# harness never closes its sessions).
RESUBSCRIBE_ENDS = BETWEEN_OWNERS | {"closed"}
STEADY_WAIT_S = 10.0  # a crash point is armed only once every client is back (``_steady``)
APPROVAL_TIMEOUT_S = 30  # the farm denies an unanswered approval's calls after this long
ANSWER_TIMEOUT_S = 8.0  # an answer's submit (acknowledged once its verdicts are durable)
DENY_SHARE = 0.25  # of the ask sessions' approvals, answered ``denied`` (seeded)
# The compact sessions' threshold (estimated tokens): a turn's 3 tool rounds add
# ~2,500 characters, so the context is compacted at most model steps.
COMPACT_THRESHOLD_TOKENS = 400


class Harness:
    def __init__(self, opts: ChaosOptions) -> None:
        self.opts = opts
        if not 0.0 <= opts.frame_rate <= 0.5:
            raise ValueError(f"--frame-rate must be between 0 and 0.5, got {opts.frame_rate}")
        if not 0.0 <= opts.provider_rate <= 1.0:
            raise ValueError(f"--provider-rate must be between 0 and 1, got {opts.provider_rate}")
        if opts.fault_gap_s <= 0:
            raise ValueError(f"--fault-gap must be positive, got {opts.fault_gap_s}")
        self.n_supervisors, self.n_brokers = farm_shape(opts.faults, opts.supervisors,
                                                        opts.brokers)
        self.kinds = parse_faults(opts.faults, supervisors=self.n_supervisors,
                                  brokers=self.n_brokers)
        if self.n_supervisors > 1 and not 1.0 <= opts.lease_s <= 600.0:
            raise ValueError(f"the lease must be 1-600 s, got {opts.lease_s}")
        if opts.store_url is not None and self.n_supervisors < 2:
            raise ValueError("--store-url is for a farm of several supervisors "
                             "(--supervisors 2 or more)")
        self.store_url: str | None = opts.store_url  # set in run() for a throwaway cluster
        self.pg_server: Any = None  # the throwaway cluster (PgServer), if the run made one
        self.until: dict[int, float] = {}  # fault index -> when a stop or a restart ended
        # calls a client retries: with several supervisors, also while a session is
        # between owners
        self.retry_kinds = BETWEEN_OWNERS if self.n_supervisors > 1 else frozenset(
            {"unavailable"})
        self.plants = plants.parse(",".join(opts.plants))
        self.home = opts.home or Path(tempfile.mkdtemp(prefix="corral-chaos-"))
        self._metrics_url: str | None = None  # where the farm's /metrics were last said
        self.schedule = (opts.schedule if opts.schedule is not None
                         else make_schedule(opts.seed, opts.duration_s, self.kinds,
                                            min_gap_s=opts.fault_gap_s))
        self.report = Report(opts.seed, self.schedule)
        self.report.plants = tuple(sorted(self.plants))
        self.report.duration_s = opts.duration_s
        self.report.coverage_s = coverage_s(self.kinds, opts.fault_gap_s)
        self.pids: dict[int, float | None] = {}  # pid -> start time (pid reuse)
        self.farm: Farm | None = None
        self.faults_over = asyncio.Event()
        self.marks: list[tuple[int, recovery.FaultMark]] = []  # (index in injected, mark)
        self.at: dict[int, float] = {}  # index in injected -> monotonic instant of the hit
        self.slow_flag = self.home / "chaos-slow-disk.flag"
        self.arm_path = self.home / "chaos-crashpoint.arm"
        self.run_tag = secrets.token_hex(4)
        self.watch = ProcWatch(self.run_tag)
        self.keeper = ExportKeeper(self.home / "exports", self.home / "exports-kept",
                                   EXPORT_KEEP, opts.seed)
        self.script: dict[str, Any] = {}
        self.loads: list[float] = []  # 1-minute load averages sampled while the farm ran
        self.sv: SupervisorClient | None = None
        self.ups: list[tuple[str, float]] = []  # (supervisor | broker, when it was up again)
        self._seen_up: set[tuple[str, int]] = set()

    # -- set-up -------------------------------------------------------------

    def prepare(self, tier_min: str = "T2") -> None:
        for i in range(self.opts.sessions):  # effects are counted on disk: start clean
            ws = self.workspace(i)
            if ws.exists() and any(ws.iterdir()):
                raise ValueError(f"workspace {ws} is not empty: a previous run's effects "
                                 "would be counted; remove it or choose another --home")
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / CHAOS_FAULTS_FILE).unlink(missing_ok=True)  # a previous run's counts
        script = self.home / "workload.json"
        if self.opts.script is not None:
            self.script = self.opts.script
        else:
            turns = max(self.opts.turns, int(self.opts.duration_s) + 100)
            self.script = make_script(turns, self.opts.steps, self.opts.seed, self.kinds,
                                      provider_rate=self.opts.provider_rate)
        script.write_text(json.dumps(self.script))
        compact_route = ""
        if self.opts.route is not None:
            route = "\n".join(f"{k} = {json.dumps(v)}" for k, v in self.opts.route.items())
        else:
            route = (f"script = {json.dumps(str(script))}\n"
                     "read_timeout_s = 3.0\nconnect_timeout_s = 2.0")
            # The compact sessions' route: the same script, and the scripted
            # provider's compaction endpoint (its compaction item carries the
            # number of outputs it replaced, so the script goes on where it was).
            compact_route = f"\n[routes.chaos-compact]\n{route}\nnative_compaction = true\n"
        store = (f"\n[store]\nurl = {json.dumps(self.store_url)}\nlease_s = "
                 f"{self.opts.lease_s:g}\n" if self.store_url else "")
        (self.home / "corral.toml").write_text(CONFIG.format(
            tier_min=tier_min, route=route, compact_route=compact_route,
            approval_timeout_s=APPROVAL_TIMEOUT_S, budget_s=BUDGET_S, store=store))

    def role(self, i: int) -> str:
        """Session ``i``'s role: with the scripted workload, every third session from
        the second compacts its context and every third from the third asks for
        approvals (so 3 sessions have one of each); a real model's run is all plain."""
        if not self.marker_checks:
            return "plain"
        return ("plain", "compact", "ask")[i % 3]

    def workspace(self, i: int) -> Path:
        """Session ``i``'s workspace: beside the home, never inside it (a farm refuses
        a workspace that overlaps its own directory: store, keys, logs, sockets)."""
        return self.home.parent / f"{self.home.name}-ws" / f"s{i}"

    @property
    def marker_checks(self) -> bool:
        """Marker-based checks need the scripted workload (a real model improvises)."""
        return self.opts.route is None

    def _track_pids(self) -> None:
        """On every change of the farm's tree: every pid it ever ran, and when the
        supervisor and the broker came up again (for ``_overlap``)."""
        if self.farm is not None:
            for c in self.farm.tree.children.values():
                if c.pid and c.pid not in self.pids:
                    try:
                        self.pids[c.pid] = psutil.Process(c.pid).create_time()
                    except psutil.Error:
                        self.pids[c.pid] = None
                # every broker of a two-broker farm counts as "broker", every supervisor
                # of several as "supervisor"
                group = ("broker" if c.spec.name.startswith("broker") else "supervisor"
                         if c.spec.name.startswith("supervisor") else c.spec.name)
                if (group in ("supervisor", "broker") and c.state == "running"
                        and c.pid and (c.spec.name, c.pid) not in self._seen_up):
                    self._seen_up.add((c.spec.name, c.pid))
                    self.ups.append((group, time.monotonic()))
            self._say_metrics()  # a restarted supervisor may serve them elsewhere

    def child_env(self) -> dict[str, str]:
        """What every farm child (and the export check) gets besides the inherited env."""
        return {plants.ENV: ",".join(sorted(self.plants))} if self.plants else {}

    # -- metrics ------------------------------------------------------------

    def _say_metrics(self) -> None:
        """With ``--metrics``: say where the farm serves them (stderr; stdout is
        the report) each time that changes (port 0: a restarted supervisor
        binds another port), and start the injected-fault counts at zero."""
        if not self.opts.metrics or self.farm is None:
            return
        child = self.farm.tree.children.get("supervisor")
        url = (child.ready or {}).get("metrics") if child is not None else None
        if not url or url == self._metrics_url:
            return
        if self._metrics_url is None:
            self._write_fault_counts()
        self._metrics_url = url
        print(f"corral chaos: metrics at {url}", file=sys.stderr, flush=True)

    def _write_fault_counts(self) -> None:
        """HOME/chaos-faults.json, the injected timed faults by kind, which the
        supervisor's metrics serve as ``corral_chaos_faults_injected_total``
        (written whole, then renamed: a scrape never reads half a file)."""
        if not self.opts.metrics or self.farm is None:
            return
        counts: dict[str, int] = {}
        for f in self.report.injected:
            if "skipped" not in f:
                counts[f["kind"]] = counts.get(f["kind"], 0) + 1
        path = self.home / CHAOS_FAULTS_FILE
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps({"faults": counts}))
        os.replace(tmp, path)

    # -- the run ------------------------------------------------------------

    async def run(self) -> Report:
        """The run; with several supervisors, on the given PostgreSQL database or on a
        throwaway cluster started (and stopped, by pid) around it."""
        if self.n_supervisors > 1 and self.store_url is None:
            from supervisor.devtools.pgserver import PgServer

            self.pg_server = await asyncio.to_thread(PgServer.start)
            self.store_url = await asyncio.to_thread(self.pg_server.new_database)
        elif self.store_url is not None and not await asyncio.to_thread(
                pgfarm.is_empty, self.store_url):
            raise ValueError("--store-url: the database already holds sessions; give the "
                             "run an empty one (a run's checks read every session)")
        self.report.farm = {"supervisors": self.n_supervisors, "brokers": self.n_brokers,
                            "store": "postgresql" if self.store_url else "sqlite",
                            "lease_s": self.opts.lease_s if self.store_url else None}
        try:
            return await self._run()
        finally:
            if self.pg_server is not None:
                await asyncio.to_thread(self.pg_server.stop)

    async def _restart_pg(self) -> float:
        """``pg_restart``: immediate shutdown of the run's cluster, then a start on the
        same port; the seconds it was down."""
        t = time.monotonic()
        await asyncio.to_thread(self.pg_server.restart)
        return time.monotonic() - t

    async def _run(self) -> Report:
        started = time.monotonic()
        cpu0 = os.times()
        self.report.host = {"cpus": os.cpu_count(),
                            "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
        self.prepare()
        frame = [k for k in self.kinds if k in FRAME_FAULTS]
        env: dict[str, str] = {crashpoints.ARM_ENV: str(self.arm_path)}
        if "store_slow" in self.kinds:
            env.update({slowdisk.DELAY_ENV: str(STORE_SLOW_DELAY_S),
                        slowdisk.FLAG_ENV: str(self.slow_flag)})
        self.farm = Farm(self.home, workers=self.opts.workers,
                         brokers=self.n_brokers if self.n_brokers > 1 else None,
                         supervisors=self.n_supervisors if self.n_supervisors > 1 else None,
                         broker_faults=(",".join(frame) + f":rate={self.opts.frame_rate}"
                                        if frame else None),
                         broker_faults_seed=self.opts.seed, supervisor_env=env,
                         log_level="INFO",
                         # The faults restart children on purpose, up to a few per second
                         # in a soak: the farm's crash-loop escalation (20 in 60 s) would
                         # stop the run, so it is set above what the schedule can cause.
                         max_restarts=100_000, metrics=self.opts.metrics,
                         on_change=self._track_pids)  # every pid the farm ever ran
        for child in self.farm.tree.children.values():  # plants reach the children only
            child.spec = dataclasses.replace(child.spec,
                                             env={**(child.spec.env or {}), **self.child_env()})
        ready = asyncio.Event()
        ph = self.report.phases
        tick = time.monotonic()

        def phase(name: str) -> None:
            nonlocal tick
            now = time.monotonic()
            ph[name] = now - tick
            tick = now
        async with asyncio.TaskGroup() as tg:
            farm_task = tg.create_task(self.farm.tree.run(on_ready=ready.set))
            async with asyncio.timeout(120):
                await ready.wait()
            self._track_pids()
            watcher = tg.create_task(self._watch())
            keeper = tg.create_task(self._keep_exports())
            frames = tg.create_task(self._count_frames()) if frame else None
            endpoint = self.farm.paths.supervisor_endpoint
            async with SupervisorClient(endpoint, timeout_s=15) as sv, \
                    BrokerClient(self.farm.paths.broker_frontend) as broker, \
                    contextlib.AsyncExitStack() as others:
                self.sv = sv
                # A two-broker farm: workers hold calls of either broker; ask both.
                more = [await others.enter_async_context(BrokerClient(ep)) for ep in
                        self.farm.info()["endpoints"].get("broker_frontends", [])[1:]]
                injector = Injector(self.farm, broker, self.slow_flag, arm_path=self.arm_path,
                                    run_tag=self.run_tag, interrupter=self._interrupt,
                                    steady=self._steady, more_brokers=more,
                                    store_url=self.store_url, lease_s=self.opts.lease_s,
                                    pg_restart=self._restart_pg if self.pg_server else None)
                runs = [await self._create(sv, i) for i in range(self.opts.sessions)]
                self.report.sessions = runs
                phase("startup")
                async with asyncio.TaskGroup() as work:
                    collectors = [work.create_task(self._collect(endpoint, r)) for r in runs]
                    drivers = [work.create_task(self._drive(sv, r)) for r in runs]
                    answerers = [work.create_task(self._answer(sv, i, r))
                                 for i, r in enumerate(runs) if r.role == "ask"]
                    await self._inject(injector, t0=time.monotonic())
                    self.faults_over.set()
                    phase("faults")
                    with contextlib.suppress(FileNotFoundError):
                        self.arm_path.unlink()  # an arming not reached stays off
                    await asyncio.gather(*drivers)
                    phase("drain")
                    # Not wedged: one more turn each, all at once, which must complete.
                    finals = await asyncio.gather(*(self._final(sv, r) for r in runs))
                    for r, ok in zip(runs, finals, strict=True):
                        r.final_ok = ok
                    phase("final_turn")
                    await asyncio.sleep(0.5)  # let collectors see the last durable events
                    for c in collectors + answerers:
                        c.cancel()
                # Calls still winding down (a worker's last long call) get their grace,
                # and the last kill its evidence window: its call's processes are
                # watched past KILL_BOUND_S (no_orphans) before the farm stops, or
                # stopping the farm would kill an orphan before it could be seen.
                await asyncio.sleep(self._evidence_wait_s())
                # And one more sample of the process table, taken now, past that bound:
                # on a loaded host the watcher's own samples lag (each scans every
                # process), and a plant run under the full test suite's load once saw
                # no sighting past the bound before the farm stopped.
                await asyncio.to_thread(self.watch.sample)
            watcher.cancel()
            keeper.cancel()
            if frames is not None:
                frames.cancel()
            farm_task.cancel()
        await asyncio.sleep(0)
        phase("stop")
        self._recovery()
        await self._check()
        phase("check")
        cpu1 = os.times()
        self.report.host.update(
            loadavg_end=[round(x, 2) for x in os.getloadavg()],
            loadavg_1m_during=_spread(self.loads),
            # this process plus the farm's children it waited for (the checks included)
            cpu_s=round(cpu1.user + cpu1.system + cpu1.children_user + cpu1.children_system
                        - cpu0.user - cpu0.system - cpu0.children_user - cpu0.children_system,
                        1))
        self.report.elapsed_s = time.monotonic() - started
        return self.report

    def _evidence_wait_s(self) -> float:
        """Seconds to keep the farm up after the last turn: at least 1, and until
        the last call-killing fault's bound plus two samples of the process table
        have passed (never more than that window)."""
        last = max((self.at[i] for i, rec in enumerate(self.report.injected)
                    if i in self.at and rec["kind"] in KILL_KINDS), default=None)
        if last is None:
            return 1.0
        window = KILL_BOUND_S + 2 * WATCH_EVERY_S
        return max(1.0, min(window, last + window - time.monotonic()))

    async def _count_frames(self) -> None:
        """Frame faults across broker restarts: the broker counts since its start, so
        its STATUS is polled every second and a drop in a counter means a new broker
        (what the old one did after its last poll is not counted: a lower bound)."""
        assert self.farm is not None
        totals = {"drop": 0, "delay": 0, "duplicate": 0}
        last = dict(totals)
        self.report.continuous["frame"] = {"rate": self.opts.frame_rate, "total": totals,
                                           "note": "lower bound across broker restarts"}
        async with BrokerClient(self.farm.paths.broker_frontend) as broker:
            while True:
                now = await _frame_counts(broker)
                if now is not None:
                    for k in totals:
                        n = int(now.get(k, 0))
                        totals[k] += n - last[k] if n >= last[k] else n
                        last[k] = n
                await asyncio.sleep(1.0)

    async def _watch(self) -> None:
        """Sample the process table while the farm runs (evidence for no_orphans)."""
        while True:
            await asyncio.to_thread(self.watch.sample)
            await asyncio.sleep(WATCH_EVERY_S)

    async def _keep_exports(self) -> None:
        """Sample the checkpoints the farm exports while it runs (the sink keeps only
        each session's last few): evidence for exports_verify across the run."""
        last_load = 0.0
        while True:
            await asyncio.to_thread(self.keeper.poll)
            if time.monotonic() - last_load >= LOAD_EVERY_S:  # the host's load, as it went
                last_load = time.monotonic()
                self.loads.append(os.getloadavg()[0])
            await asyncio.sleep(EXPORT_POLL_S)

    async def _create(self, sv: SupervisorClient, i: int) -> SessionRun:
        ws = self.workspace(i)
        ws.mkdir(parents=True, exist_ok=True)
        # The farm set this process's umask to 077 (its home is private).
        os.chmod(ws.parent, 0o755)
        os.chmod(ws, 0o755)
        (ws / ID_FILE).write_text(f"{self.run_tag}-{i}\n")
        (ws / ID_FILE).chmod(0o644)
        role = self.role(i)
        spec: dict[str, Any] = {"workspace": str(ws)}
        if role == "compact":
            spec.update(route="chaos-compact",
                        compaction_threshold_tokens=COMPACT_THRESHOLD_TOKENS)
        elif role == "ask":
            spec["approval"] = "ask"
        sid = await _retry(lambda: sv.create_session(**spec), kinds=self.retry_kinds)
        return SessionRun(str(sid), ws, role=role)

    async def _collect(self, endpoint: str, run: SessionRun) -> None:
        """What a client of this session sees live, with receive times. One client
        per session: a client that takes a slow supervisor for a lost one
        resubscribes while its old subscriptions still stand on the server, which
        caps them at 256 per client (an hour-long soak with 16 sessions on one
        client hit that cap after 17 minutes)."""
        async with SupervisorClient(endpoint, timeout_s=15) as sv:
            run.client = sv
            try:
                await self._follow(sv, run)
            finally:
                run.resent = sv.resent_events

    async def _follow(self, sv: SupervisorClient, run: SessionRun) -> None:
        """``_collect``'s loop: the session's events from the last sequence seen."""
        after = 0
        while True:
            try:
                async for event in sv.events(run.session_id, after_sequence=after,
                                             reconnect_timeout_s=600):
                    run.live.append((time.monotonic(), event))
                    if event.get("sequence", 0) > 0:
                        after = int(event["sequence"])
                return
            except SupervisorError as exc:
                # Between owners (the old owner's lease lapsed, no one has taken
                # the session yet) a subscription is answered unknown_session, and
                # store_unavailable while PostgreSQL restarts; a client retries, from
                # the last sequence it saw (docs/multihost.md).
                if exc.kind not in RESUBSCRIBE_ENDS or self.n_supervisors < 2:
                    raise
                self.report.retries_between_owners += 1
                await asyncio.sleep(0.2)

    async def _steady(self) -> bool:
        """Wait (up to ``STEADY_WAIT_S``) until the supervisor answers and every
        session's event client is subscribed to that same instance: a crash point
        armed then fires where clients watch (armed during a restart, it would fire
        in the resume, before any client is back). False if never."""
        deadline = time.monotonic() + STEADY_WAIT_S
        while time.monotonic() < deadline:
            if self.sv is not None:
                try:
                    async with asyncio.timeout(2.0):
                        await self.sv.status()
                except (SupervisorError, TimeoutError):
                    pass
                else:
                    srv = self.sv.server_id
                    if self.n_supervisors > 1:  # each client at its session's owner
                        if self._all_supervisors_up() and all(
                                r.client is not None and r.client.subscribed(r.session_id)
                                for r in self.report.sessions):
                            return True
                    elif srv is not None and all(
                            r.client is not None and r.client.server_id == srv
                            and r.client.subscribed(r.session_id)
                            for r in self.report.sessions):
                        return True
            await asyncio.sleep(0.1)
        return False

    def _all_supervisors_up(self) -> bool:
        return self.farm is not None and sum(
            1 for c in self.farm.tree.children.values()
            if c.spec.name.startswith("supervisor") and c.state == "running"
            and c.pid) == self.n_supervisors

    async def _answer(self, sv: SupervisorClient, i: int, run: SessionRun) -> None:
        """Answer an ask session's approval requests as a user would: each one seen
        (live or replayed after a restart) once, after a short seeded delay,
        ``approved`` or (a ``DENY_SHARE`` of them) ``denied``. A stale reply (the
        supervisor had no waiter for it yet) is answered again; what was sent is kept
        in ``run.answers`` for ``approvals_kept``."""
        rng = random.Random(f"{self.opts.seed}-answer-{i}")
        seen = 0
        while True:
            for _, e in run.live[seen:]:
                seen += 1
                if e.get("type") != "exec_approval_request" or e.get("sequence", 0) <= 0:
                    continue
                approval_id = str((e.get("payload") or {}).get("id"))
                if approval_id in run.answers:
                    continue
                decision = "denied" if rng.random() < DENY_SHARE else "approved"
                await asyncio.sleep(rng.uniform(0.05, 0.5))
                answer: dict[str, Any] = {"decision": decision, "subs": [],
                                          "at": time.time()}
                run.answers[approval_id] = answer
                await self._send_answer(sv, run, approval_id, answer)
            await asyncio.sleep(0.05)

    async def _send_answer(self, sv: SupervisorClient, run: SessionRun, approval_id: str,
                           answer: dict[str, Any]) -> None:
        """Submit one answer; resubmit (a few times, bounded) while the farm says it
        was stale and the request is still open (a restarted supervisor not yet
        waiting for it)."""
        for _ in range(10):
            try:
                # acknowledged once durable; a supervisor killed before that is
                # retried (its resumed session still waits for the answer)
                sub = await _retry(lambda: sv.call(
                    "submit", timeout_s=ANSWER_TIMEOUT_S, session_id=run.session_id,
                    op={"type": "exec_approval", "id": approval_id,
                        "decision": answer["decision"]}), kinds=self.retry_kinds)
            except SupervisorError as exc:
                answer.setdefault("errors", []).append(str(exc))
                return
            answer["subs"].append(str(sub))
            await asyncio.sleep(0.5)
            if not _stale(run.live, str(sub)) or _approval_closed(run.live, approval_id):
                return

    async def _turn(self, sv: SupervisorClient, run: SessionRun) -> bool:
        """Submit one turn and wait (with a deadline) for its terminal event."""
        seen = len(run.live)
        run.busy = True
        try:
            sub = await _retry(lambda: sv.submit(run.session_id, {
                "type": "user_input", "text": self.opts.prompt.format(n=len(run.submissions))}),
                kinds=self.retry_kinds)
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

    async def _final(self, sv: SupervisorClient, run: SessionRun) -> bool:
        """The turn after the faults must complete. Frame and provider faults stay on,
        so a turn may end aborted once its model call ran out of attempts (a clean,
        reported end): up to ``FINAL_TRIES`` turns are submitted; a session none of
        whose turns completes within its deadline is wedged."""
        for _ in range(FINAL_TRIES):
            if await self._turn(sv, run):
                return True
            if not run.submissions or not _aborted_cleanly(run.live, run.submissions[-1]):
                return False  # no end at all within the deadline: wedged
        return False

    async def _drive(self, sv: SupervisorClient, run: SessionRun) -> None:
        limit = self.opts.max_turns_per_session or self.opts.turns - 2
        while not self.faults_over.is_set() and run.turns_done < limit:
            if not await self._turn(sv, run) and not self.faults_over.is_set():
                await asyncio.sleep(0.2)

    async def _interrupt(self, pick: int) -> dict[str, Any] | None:
        """Interrupt a turn early in one of its long tool calls (``interrupt_tool``): the
        call has most of ``LONG_S`` to run, so only a working kill ends it promptly."""
        deadline = time.monotonic() + 3.0 + LONG_S
        while time.monotonic() < deadline:
            now = time.monotonic()
            fresh = []
            for i, r in enumerate(self.report.sessions):
                call = _open_long_call(r.live, self.opts.steps)
                if call is not None and 0.5 <= now - call[2] <= 1.5:  # running, young
                    fresh.append((i, r, call))
            if fresh and self.sv is not None:
                i, r, (turn_id, k, _) = fresh[pick % len(fresh)]
                sent = time.monotonic()
                try:
                    async with asyncio.timeout(3.0):
                        await self.sv.submit(r.session_id,
                                             {"type": "interrupt", "turn_id": turn_id})
                except (SupervisorError, TimeoutError) as exc:
                    return {"target": r.session_id, "error": str(exc), "call": [i, k]}
                return {"target": r.session_id, "turn_id": turn_id, "call": [i, k],
                        "sent_at": sent}
            await asyncio.sleep(0.05)
        return None

    # -- faults -------------------------------------------------------------

    async def _inject(self, injector: Injector, t0: float) -> None:
        """Fire the schedule; a skipped fault is retried (up to ``RETRIES`` times) in
        the next slots, before the slot's own fault, so every enabled kind gets
        reached; slots the fault phase's end overtook are not fired (slow fires
        delay the rest). Then, in a run at least ``coverage_s`` long, every enabled timed
        kind that never hit its window gets up to ``RETRIES`` more tries, one
        ``fault_gap_s`` apart (``_until_hit``): a short run still shows each kind
        landing where it must, not only tried."""
        debt: list[tuple[Fault, int]] = []
        for n, slot in enumerate(self.schedule):
            if time.monotonic() - t0 >= self.opts.duration_s:
                # Slow fires (waits for a window, restarts) pushed the rest past the
                # fault phase: not fired (counted), the phase keeps its length.
                self.report.unfired = len(self.schedule) - n
                break
            wait = t0 + slot.at_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            fault, tries = slot, 0
            if debt:
                fault, tries = debt.pop(0)
                debt.append((slot, 0))
            record = await self._fire(injector, fault, t0)
            if "skipped" in record and tries < RETRIES:
                record["retry"] = tries + 1
                debt.append((fault, tries + 1))
        if self.opts.schedule is None and self.opts.duration_s >= self.report.coverage_s:
            await self._until_hit(injector, t0)
        rest = t0 + self.opts.duration_s - time.monotonic()
        if rest > 0:
            await asyncio.sleep(rest)

    async def _until_hit(self, injector: Injector, t0: float) -> None:
        for kind in timed_kinds(self.kinds):
            first = next((f for f in self.schedule if f.kind == kind), None)
            for tries in range(RETRIES):
                if first is None or any(r["kind"] == kind and r.get("hit")
                                        and "skipped" not in r for r in self.report.injected):
                    break
                await asyncio.sleep(self.opts.fault_gap_s)
                fault = dataclasses.replace(first, pick=first.pick + tries + 1)
                record = await self._fire(injector, fault, t0)
                record["until_hit"] = tries + 1

    async def _fire(self, injector: Injector, fault: Fault, t0: float) -> dict[str, Any]:
        """Fire one fault, mark its instant, and record it."""
        index = len(self.report.injected)
        at_s = round(time.monotonic() - t0, 3)

        def mark(service: str | None, at: float | None = None, kind: str = fault.kind,
                 index: int = index, sessions: list[str] | None = None) -> None:
            when = time.monotonic() if at is None else at
            self.at[index] = when
            group = recovery_group(kind)
            if group is None:
                return
            marks = {r.session_id: _count_upto(r.live, when) for r in self.report.sessions}
            only = frozenset(sessions) if sessions is not None else None
            self.marks.append((index, recovery.FaultMark(group, when, service, marks, only)))

        record = await injector.fire(fault, mark)
        if index in self.at and ("down_s" in record or record["kind"] == "supervisor_stop"):
            # when the stop or the restart ended (the farm's "down" window, ``_downs``)
            self.until[index] = self.at[index] + float(
                record.get("down_s", record.get("duration_s")) or 0.0)
        record["at_s"] = at_s  # when the fire began (it may wait for its window)
        if index in self.at:  # the instant it hit (SIGSTOP, kill, interrupt, crash claim)
            record["hit_at_s"] = round(self.at[index] - t0, 3)
        self.report.injected.append(record)
        if "skipped" not in record:
            self._write_fault_counts()
        log.info("chaos: %s", record)
        return record

    def _recovery(self) -> None:
        lives = {r.session_id: r.live for r in self.report.sessions}
        for index, fm in self.marks:
            hit = recovery.affected(fm, lives)
            record = self.report.injected[index]
            record["affected"] = {sid: None if t is None else round(t, 3)
                                  for sid, t in sorted(hit.items())}
            times = [t for t in hit.values() if t is not None]
            self.report.recovery.setdefault(fm.group, []).extend(times)
            self.report.recovery_by_kind.setdefault(record["kind"], []).extend(times)
            missing = sum(1 for t in hit.values() if t is None)
            if missing:
                self.report.unrecovered[fm.group] = (
                    self.report.unrecovered.get(fm.group, 0) + missing)
            if not hit:
                self._explain(index, fm, record, lives)

    def _explain(self, index: int, fm: recovery.FaultMark, record: dict[str, Any],
                 lives: dict[str, recovery.LiveLog]) -> None:
        """A fault that affected no session: say why from the evidence, or it is a
        ``recovery_accounted`` violation: a worker that held requests when it was
        frozen (the broker's STATUS read after the SIGSTOP) must cost some session
        a loss report (``worker_lost`` on a tool call or a model step, or an
        idempotent call's second attempt) within the loss bound."""
        if fm.group == "supervisor" and fm.only is not None:
            record["explained"] = "the killed supervisor owned no session with a turn running"
            return
        if fm.group != "worker":
            record["explained"] = {
                "supervisor": "no turn was running", "broker": "nothing was in flight",
                "takeover": "the stopped supervisor owned no session with a turn running",
                "store": "no turn was running",
                "provider": "no model stream was cut (none open at the provider)",
            }.get(fm.group, "not measured")
            return
        held = record.get("held")
        if not held:
            record["explained"] = ("the worker held nothing when frozen" if held == []
                                   else "the broker did not list the frozen worker")
            return
        excused, extra = self._overlap(index)
        if excused:
            record["explained"] = "the supervisor or the broker was killed in its window"
            return
        bound = LIVENESS_WINDOW_S + LOSS_MARGIN_S + extra
        for live in lives.values():
            for t, e in live[_count_upto(live, fm.at):]:
                if t > fm.at + bound:
                    break
                if _loss_evidence(e):
                    record["explained"] = "lost requests were reported outside open work"
                    return
        # Requests whose budget ran out before the broker could expire the frozen
        # worker end ``timeout``, rightly (the soak's fault #468: 4 model requests
        # sent ~9.5 s before the freeze, failed by the broker's deadline 0.45-0.7
        # s into it; at the expiry the worker held nothing open).
        ran_out = sum(inv.ran_out_before_expiry(live, fm.at, LIVENESS_WINDOW_S, BUDGET_S,
                                                fm.at + bound) for live in lives.values())
        if ran_out >= len(held):
            record["explained"] = (f"its {len(held)} request(s) ran out of budget before "
                                   "the liveness window could expire the worker "
                                   f"({ran_out} deadline ending(s) seen)")
            return
        self.report.violations.append(inv.Violation(
            "recovery_accounted", "", None,
            f"fault #{index} ({record['kind']}) froze {record.get('target')} holding "
            f"{held} and no session saw a loss report within {bound:.1f}s"))

    def _down_end(self, j: int) -> float | None:
        """For fault ``j`` that took a supervisor, the broker or the store away: when
        its sessions could report again (None: not such a fault). A kill: ``RESUME_S``
        after the farm had the process running again (never: infinity). A supervisor
        stopped past its lease: its sessions are resumed elsewhere once the lease
        lapsed and a claim round ran, or by it at SIGCONT. PostgreSQL restarted: the
        leases lapsed meanwhile, so the sessions are taken again after it is back."""
        rec = self.report.injected[j]
        group = recovery_group(rec["kind"])
        if j not in self.at or "skipped" in rec:
            return None
        start = self.at[j]
        if group in ("supervisor", "broker"):
            up = next((t for name, t in self.ups if name == group and t > start), None)
            return (up if up is not None else float("inf")) + RESUME_S
        takeover = self.opts.lease_s + CLAIM_S + RESUME_S
        if group == "takeover":
            return max(self.until.get(j, float("inf")), start + takeover) + RESUME_S
        if group == "store":
            return self.until.get(j, float("inf")) + takeover
        return None

    def _downs(self) -> list[tuple[float, float]]:
        """When a supervisor, the broker or the store was down (``_down_end``)."""
        out = []
        for j in range(len(self.report.injected)):
            end = self._down_end(j)
            if end is not None:
                out.append((self.at[j], end))
        return out

    def _overlap(self, index: int) -> tuple[bool, float]:
        """For fault ``index``: whether the supervisor or the broker was down during
        its loss bound (from its kill to when the farm had it running again, plus
        ``RESUME_S`` to resume the sessions), which excuses a late or restart-made
        loss report; and the seconds that store faults overlapping the bound may
        have delayed a commit."""
        at = self.at.get(index)
        if at is None:
            return True, 0.0
        hi = at + LIVENESS_WINDOW_S + LOSS_MARGIN_S
        extra = 0.0
        for j, rec in enumerate(self.report.injected):
            if j == index or "skipped" in rec or j not in self.at:
                continue
            start = self.at[j]
            end = self._down_end(j)
            if end is not None and start <= hi and end >= at:
                return True, 0.0
            if rec["kind"].startswith("store_"):
                end = start + float(rec.get("duration_s") or 0.0)
                if start <= hi + extra and end >= at:
                    extra += float(rec.get("duration_s") or 0.0)
        return False, extra

    # -- checking -----------------------------------------------------------

    async def _check(self) -> None:
        from supervisor.store import Store
        from supervisor.store.pg.store import PgStore

        v = self.report.violations
        self.report.checks = [c for c in inv.ALL_CHECKS
                              if (self.marker_checks or c not in inv.MARKER_CHECKS)
                              and (self.store_url or c not in inv.LEASE_CHECKS)]
        # off the loop: a process still listed in a cgroup gets seconds to die
        v.extend(await asyncio.to_thread(inv.no_orphans, dict(self.pids)))
        await asyncio.to_thread(self.watch.sample)
        left = await asyncio.to_thread(self.watch.alive_now)
        lives = [(r.session_id, r.live) for r in self.report.sessions]
        for (what, i, k), pid in sorted(left.items()):
            sid = lives[i][0] if i < len(lives) else ""
            v.append(inv.Violation("no_orphans", sid, None,
                                   f"process chaos-{what} of call m-{k} (pid {pid}) outlived "
                                   "the farm"))
        evidence.kill_leftovers(list(left.values()))
        self.report.proc_samples = self.watch.samples
        seen = {tok: (s.pid, s.last) for tok, s in self.watch.seen.items()}
        if self.marker_checks:
            v.extend(inv.orphans_seen(seen, lives, ORPHAN_GRACE_S))
            kills = [inv.Kill(i, rec["kind"], self.at[i],
                              frozenset((a, b) for a, b in rec.get("calls", [])),
                              self._overlap(i)[1])
                     for i, rec in enumerate(self.report.injected)
                     if rec.get("calls") and i in self.at]
            counts, bad = inv.killed_calls(kills, lives, LIVENESS_WINDOW_S + LOSS_MARGIN_S,
                                           self._downs())
            cut = [(i, rec["kind"], self.at[i], frozenset(
                       [tuple(rec["call"])] if rec["kind"] == "interrupt_tool"
                       else (tuple(c) for c in rec.get("calls", []))))
                   for i, rec in enumerate(self.report.injected)
                   if i in self.at and rec["kind"] in KILL_KINDS
                   and (rec.get("calls") or rec.get("call")) and "error" not in rec]
            frozen: dict[tuple[int, int], list[tuple[float, float]]] = {}
            for j, rec in enumerate(self.report.injected):
                if rec["kind"] == "worker_hang" and j in self.at and "skipped" not in rec:
                    for c in rec.get("calls", []):
                        frozen.setdefault((c[0], c[1]), []).append(
                            (self.at[j], float(rec.get("duration_s") or 0.0)))
            v.extend(inv.orphans_after_kill(cut, seen, lives, KILL_BOUND_S, frozen))
            self.report.killed_calls = counts
            v.extend(bad)
        asked = requests_in(self.script)
        # The farm's store, opened after it stopped (on PostgreSQL: no owner, no leases,
        # a reader of what the disk holds).
        store: Any = (await PgStore.open(self.store_url) if self.store_url
                      else await Store.open(self.home / "corral.db"))
        try:
            for r in self.report.sessions:
                try:
                    replay = [_wire(e)
                              for e in await store.replay_events(SessionId(r.session_id))]
                except StoreError as exc:  # a runaway journal must be reported, not crash
                    v.append(inv.Violation("replay_equals_live", r.session_id, None,
                                           f"the store's events could not be replayed: "
                                           f"{type(exc).__name__}: {exc}"))
                    continue
                live = [e for _, e in r.live]
                v.extend(inv.turn_ends_once(r.session_id, r.submissions, replay))
                if not r.final_ok:
                    v.append(inv.Violation("not_wedged", r.session_id, None,
                                           "the turn after the faults did not complete "
                                           f"({_last_seen(r, replay)})"))
                loaded = await store.load(SessionId(r.session_id))
                if loaded is not None:
                    v.extend(inv.one_output_per_call(r.session_id, loaded.context))
                    v.extend(inv.transcript_complete(r.session_id, replay, loaded.context))
                    v.extend(inv.usage_accounted(
                        r.session_id, replay, dict(loaded.state.total_usage),
                        inv.scripted_usage(self.script) if self.marker_checks else None))
                # only answers the farm acknowledged (an answer whose every submit
                # failed was never given)
                v.extend(inv.approvals_kept(r.session_id, replay, {
                    a: ans for a, ans in r.answers.items() if ans["subs"]}))
                v.extend(inv.compaction_once(
                    r.session_id, replay,
                    loaded.state.compaction_count if loaded is not None else None))
                if self.marker_checks:
                    v.extend(inv.effects(r.session_id, replay, count_markers(r.workspace),
                                         asked))
                    self.report.repeated_requests += inv.repeated_requests(replay)
                    v.extend(inv.outputs_match_calls(r.session_id, replay))
                if "frame_drop" not in self.kinds:
                    v.extend(inv.silent_timeouts(r.session_id, replay,
                                                 models="provider_hang" not in self.kinds))
                v.extend(inv.replay_equals_live(r.session_id, live, replay))
                if r.resent:
                    v.append(inv.Violation(
                        "replay_equals_live", r.session_id, None,
                        f"the supervisor sent {r.resent} event(s) again within one "
                        "subscription (at or below a sequence it had sent, or the "
                        "after_sequence asked): the SDK client drops them, a client "
                        "without that guard sees duplicates"))
                self._provider_faults(live)
        finally:
            await store.close()
        if self.store_url:
            v.extend(await asyncio.to_thread(self._fencing))
        await asyncio.to_thread(self.keeper.finish)
        self.report.exports_seen = len(self.keeper.seen)
        results = await self._exports()
        self.report.exports = len(results)
        v.extend(inv.exports_verify(results))
        v.extend(await self._exports_match_store())
        v.extend(self._reached())

    def _fencing(self) -> list[inv.Violation]:
        """``fencing`` from the events as the disk holds them, with their leases; and
        the owners each session's events came from, in turn (the report's
        ``owners``)."""
        assert self.store_url is not None
        sids = [r.session_id for r in self.report.sessions]
        rows, leases = pgfarm.event_leases(self.store_url, sids)
        out: list[inv.Violation] = []
        for sid in sids:
            bad, turns = inv.fencing(sid, rows.get(sid, []), leases.get(sid))
            out.extend(bad)
            self.report.owners[sid] = turns
        return out

    def _provider_faults(self, live: list[dict[str, Any]]) -> None:
        """Provider faults served to one session (estimate: the script's faulty entries
        below the number of model outputs the session got)."""
        outputs = sum(1 for e in live if e.get("type") == "model_step_completed"
                      and (e.get("payload") or {}).get("outcome") == "completed"
                      and e.get("sequence", 0) > 0)
        for entry in self.script.get("responses", [])[:outputs]:
            kind = _provider_kind(entry)
            if kind:
                self.report.provider_faults[kind] = self.report.provider_faults.get(kind, 0) + 1

    async def _exports(self) -> dict[str, dict[str, Any]]:
        """Every export checked (and tampered with) by ``exportcheck`` in a child process
        with the farm's environment: the verify under test is the farm's."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "supervisor.chaos.exportcheck", str(self.keeper.dest),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, **self.child_env()})
        try:
            async with asyncio.timeout(EXPORTCHECK_S):
                out, err = await proc.communicate()
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return {"(exportcheck)": {"problems": [
                f"the export check took over {EXPORTCHECK_S} s"]}}
        if proc.returncode != 0:
            return {"(exportcheck)": {"problems": [err.decode(errors="replace")[-500:]]}}
        result: dict[str, dict[str, Any]] = json.loads(out)
        return result

    async def _exports_match_store(self) -> list[inv.Violation]:
        """``export_matches_store``: each kept export's transcript against the store's
        context at the position it names (the store reopened, the farm stopped)."""
        from supervisor.store import Store
        from supervisor.store.pg.store import PgStore
        store: Any = (await PgStore.open(self.store_url) if self.store_url
                      else await Store.open(self.home / "corral.db"))
        out: list[inv.Violation] = []
        try:
            for path in sorted(self.keeper.dest.glob("*.json")):
                try:
                    doc = json.loads(path.read_text())
                    resume = doc["content"]["logical_resume"]
                    pos = resume["position"]
                    stored = await store.context_at(
                        SessionId(str(resume["session_id"])), at_batch=int(pos["at_batch"]),
                        epoch=int(pos["epoch"]))
                except (OSError, ValueError, KeyError, TypeError):
                    continue  # unreadable or malformed: exports_verify reports it
                out.extend(inv.export_matches_store(path.name, doc, stored))
        finally:
            await store.close()
        return out

    def _reached(self) -> list[inv.Violation]:
        """``faults_reached``: a run at least ``coverage_s`` long injected every kind."""
        if self.opts.schedule is not None or self.opts.duration_s < self.report.coverage_s:
            return []
        done = {f["kind"] for f in self.report.injected if "skipped" not in f}
        return [inv.Violation("faults_reached", "", None,
                              f"fault kind {kind} was never injected in a "
                              f"{self.opts.duration_s:g}s run (coverage bound "
                              f"{self.report.coverage_s:g}s)")
                for kind in timed_kinds(self.kinds) if kind not in done]


def recovery_group(kind: str) -> str | None:
    """The recovery group of a fault kind (None: not a process fault)."""
    if kind == "supervisor_stop":
        return "takeover"
    if kind == "pg_restart":
        return "store"
    if kind.startswith("worker_"):
        return "worker"
    if kind.startswith("crash_") or kind == "supervisor_kill":
        return "supervisor"
    if kind in ("broker_kill", "broker_kill_one", "provider_kill"):
        return kind.split("_")[0]
    return None


def _last_seen(run: SessionRun, replay: list[dict[str, Any]]) -> str:
    """Where a wedged session stood: its last durable event seen live and the store's."""
    seen = [e for _, e in run.live if e.get("sequence", 0) > 0]
    live = f"{seen[-1]['type']} #{seen[-1]['sequence']}" if seen else "nothing"
    stored = f"{replay[-1]['type']} #{replay[-1]['sequence']}" if replay else "nothing"
    last = run.submissions[-1] if run.submissions else None
    return f"last seen live: {live}; last stored: {stored}; last submission {last}"


def _aborted_cleanly(live: recovery.LiveLog, sub: str) -> bool:
    """Whether submission ``sub`` ended ``turn_aborted`` with a reason."""
    return any(e.get("submission_id") == sub and e.get("type") == "turn_aborted"
               and (e.get("payload") or {}).get("reason") for _, e in live)


def _stale(live: recovery.LiveLog, sub: str) -> bool:
    """Whether the farm answered submission ``sub`` with a stale-approval warning."""
    return any(e.get("submission_id") == sub and e.get("type") == "warning" for _, e in live)


def _approval_closed(live: recovery.LiveLog, approval_id: str) -> bool:
    """Whether every call of approval ``approval_id`` has a durable outcome."""
    calls: set[str] = set()
    for _, e in live:
        p = e.get("payload") or {}
        if e.get("type") == "exec_approval_request" and p.get("id") == approval_id:
            calls = {str(c.get("call_id")) for c in p.get("calls", [])}
        elif e.get("type") in ("tool_call_begin", "tool_call_end") and calls:
            calls.discard(str(p.get("call_id")))
    return not calls


def _spread(xs: list[float]) -> dict[str, float | int]:
    """min, median, max and count of samples (an empty list gives the count only)."""
    if not xs:
        return {"samples": 0}
    ys = sorted(xs)
    return {"min": round(ys[0], 2), "median": round(ys[len(ys) // 2], 2),
            "max": round(ys[-1], 2), "samples": len(ys)}


def _loss_evidence(e: dict[str, Any]) -> bool:
    """A durable event saying a request was lost with its worker."""
    if e.get("sequence", 0) <= 0:
        return False
    p = e.get("payload") or {}
    if e.get("type") == "tool_call_end":
        return bool((p.get("error") or {}).get("kind") == "worker_lost")
    if e.get("type") == "model_step_completed":
        return bool(((p.get("diagnostics") or {}).get("error") or {}).get("kind")
                    == "worker_lost")
    return e.get("type") == "tool_call_begin" and int(p.get("attempt") or 1) > 1


def _count_upto(live: recovery.LiveLog, at: float) -> int:
    return bisect.bisect_right(live, at, key=lambda te: te[0])


def _open_long_call(live: recovery.LiveLog, steps: int) -> tuple[str, int, float] | None:
    """(turn id, k, begin's receive time) of a long shell call begun and not ended,
    as the client saw it."""
    open_calls: dict[str, tuple[str, int, float]] = {}
    for t, e in live[-200:]:
        p = e.get("payload") or {}
        if e.get("type") == "tool_call_begin" and p.get("name") == "shell":
            m = inv.MARKER_ARG_RE.search(json.dumps(p.get("arguments", "")))
            if m and int(m.group(1)) % (steps + 1) == 0:
                open_calls[str(p.get("call_id"))] = (str(p.get("turn_id")), int(m.group(1)), t)
        elif e.get("type") == "tool_call_end":
            open_calls.pop(str(p.get("call_id")), None)
        elif e.get("type") in ("turn_complete", "turn_aborted"):
            open_calls.clear()
    return next(iter(open_calls.values()), None)


def _provider_kind(entry: dict[str, Any]) -> str | None:
    if "times" not in entry:
        return None
    if entry.get("status") == 429:
        return "provider_429"
    if entry.get("status") == 500:
        return "provider_500"
    if entry.get("hang"):
        return "provider_hang"
    if "cut_after_bytes" in entry:
        return "provider_cut"
    return None


def _wire(e: Any) -> dict[str, Any]:
    return {"sequence": e.sequence, "type": e.type, "payload": e.payload,
            "submission_id": e.submission_id, "created_at": e.created_at}


async def _frame_counts(broker: BrokerClient) -> dict[str, Any] | None:
    """The broker's frame-fault counters since its start (None: no answer now)."""
    try:
        status = await broker.status(timeout_s=1.0)
    except (BrokerError, TimeoutError):  # down or restarting: try again later
        return None
    faults: dict[str, Any] = (status.get("counters") or {}).get("faults") or {}
    return faults


async def _retry(make: Any, *, attempts: int = 60,
                 kinds: frozenset[str] = frozenset({"unavailable"})) -> Any:
    for i in range(attempts):
        try:
            return await make()
        except SupervisorError as exc:
            if exc.kind not in kinds or i == attempts - 1:
                raise
            await asyncio.sleep(0.5)
    raise AssertionError("unreachable")


def render(report: dict[str, Any]) -> str:
    lines = [f"chaos seed {report['seed']}: {len(report['violations'])} violation(s), "
             f"{report['elapsed_s']}s"]
    for k, n in report["counts"].items():
        lines.append(f"  {k:<24} {n}")
    if report.get("plants"):
        lines.append(f"  plants                   {', '.join(report['plants'])}")
    for group, r in report["recovery"].items():
        if r["count"]:
            lines.append(f"  recovery {group:<15} n={r['count']} p50={r['p50_s']}s "
                         f"p99={r['p99_s']}s unrecovered={r['unrecovered']}")
        else:
            lines.append(f"  recovery {group:<15} n=0: no session affected (each fault's "
                         "'explained' in --json says why)")
    for kind, k in sorted(report.get("faults_by_kind", {}).items()):
        lines.append(f"  fault {kind:<22} injected={k['injected']} skipped={k['skipped']}")
    for v in report["violations"][:10]:
        lines.append(f"  VIOLATION {v['invariant']} session={v['session_id']} "
                     f"seq={v['sequence']}: {v['detail']}")
    return "\n".join(lines)


def main(ns: Any) -> int:
    opts = ChaosOptions(seed=ns.seed, duration_s=ns.duration, sessions=ns.sessions,
                        faults=ns.faults, workers=getattr(ns, "workers", 3),
                        home=ns.home if ns.home != Path.home() / ".corral" else None,
                        plants=tuple(getattr(ns, "plant", None) or ()),
                        fault_gap_s=getattr(ns, "fault_gap", 2.5),
                        frame_rate=getattr(ns, "frame_rate", 0.02),
                        provider_rate=getattr(ns, "provider_rate", 0.15),
                        metrics=getattr(ns, "metrics", None),
                        supervisors=getattr(ns, "supervisors", None),
                        brokers=getattr(ns, "brokers", None),
                        store_url=getattr(ns, "store_url", None))
    try:
        report = asyncio.run(Harness(opts).run()).as_dict()
    except ValueError as exc:  # a bad --faults word: said as every usage error is
        if ns.json:
            print(json.dumps({"ok": False, "error": {"kind": "usage", "message": str(exc)}},
                             sort_keys=True))
        else:
            print(f"corral: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, sort_keys=True) if ns.json else render(report))
    if report["violations"]:
        first = report["violations"][0]
        print(f"seed {report['seed']}: first violation: {first['invariant']} in session "
              f"{first['session_id']} at sequence {first['sequence']}: {first['detail']}")
        return 1
    return 0
