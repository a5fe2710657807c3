"""Prometheus metrics of the whole farm, served by the supervisor.

Two sources, one registry:
- **Observed in the supervisor** (counters and histograms updated as things
  happen): the durable events of each committed step (turns, tool calls,
  approvals, compactions), each broker request's timings and outcome (model
  calls: time to first token, duration, tokens) and each store commit's
  latency. ``hub.Telemetry`` feeds them.
- **Read at scrape time** (``FarmCollector``): sessions by state and approvals
  pending from the manager, workers/slots/queues/expiries/failures/chaos
  faults from the broker's STATUS (the same answer ``corral status`` shows),
  and process restarts by role from HOME/farm.json. The scrape runs in the
  HTTP server's thread and asks the event loop for one snapshot, bounded by
  ``SNAPSHOT_TIMEOUT_S``; a broker that does not answer gives
  ``corral_broker_up 0``, never a failed scrape.

Invariants:
- Names follow the Prometheus conventions: ``corral_`` prefix, ``_total`` for
  counters, base units (``_seconds``, tokens).
- Every label is bounded (``labels.Bounded``): no session, turn, call or
  worker id (a worker's own ``tool@ID`` service is ``tool_pinned``).
- One sample per series: raw values that share a label value (``other``,
  ``tool_pinned``) are summed, never exposed twice.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from broker.protocol import Failure
from supervisor.engine import events as ev
from supervisor.store.records import EventRecord
from supervisor.telemetry.labels import CHAOS_FAULTS_FILE, Bounded

log = logging.getLogger(__name__)

SNAPSHOT_TIMEOUT_S = 3.0
MAX_OPEN_TURNS = 10_000  # turn start times kept for the duration histogram
_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 1800)
_FAST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_ROLE = re.compile(r"^(.*?)(-\d+)?$")
# A worker's own tool service (``tool@<16 hex>``, MCP affinity; a new one at
# each worker start) and an image's (``tool@img-<hex>``) are ids, not classes.
PINNED_SERVICE = "tool_pinned"
IMAGE_SERVICE = "tool_image"

Snapshot = Callable[[], Coroutine[Any, Any, dict[str, Any]]]


class FarmMetrics:
    """The supervisor's own series, and the collector of the farm's."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.route = Bounded(16)
        self.tool = Bounded(64)
        self.outcome = Bounded(32)
        self.reason = Bounded(16)
        self.tier = Bounded(8)
        self.turns_started = Counter("corral_turns_started", "Turns started.", registry=r)
        self.turns_ended = Counter("corral_turns_ended", "Turns ended, by reason "
                                   "(completed, interrupted, rejected, failed).",
                                   ["reason"], registry=r)
        self.turn_duration = Histogram("corral_turn_duration_seconds",
                                       "Turn duration, from turn_started to its end.",
                                       buckets=_DURATION_BUCKETS, registry=r)
        self.model_calls = Counter("corral_model_calls", "Model calls by route and outcome "
                                   "(ok, or the failure kind).", ["route", "outcome"],
                                   registry=r)
        self.model_ttft = Histogram("corral_model_time_to_first_token_seconds",
                                    "Time from the model request to its first streamed "
                                    "chunk, seen by the supervisor.", ["route"],
                                    buckets=_DURATION_BUCKETS, registry=r)
        self.model_duration = Histogram("corral_model_call_duration_seconds",
                                        "Model call duration, seen by the supervisor.",
                                        ["route"], buckets=_DURATION_BUCKETS, registry=r)
        self.tokens = Counter("corral_model_tokens", "Tokens by route and type (input, "
                              "cached_input, output, reasoning_output).", ["route", "type"],
                              registry=r)
        self.tool_calls = Counter("corral_tool_calls", "Tool calls by tool, outcome and "
                                  "sandbox tier.", ["tool", "outcome", "tier"], registry=r)
        self.tool_duration = Histogram("corral_tool_duration_seconds",
                                       "Tool run time reported by the worker.", ["tool"],
                                       buckets=_DURATION_BUCKETS, registry=r)
        self.approvals = Counter("corral_approvals_requested", "Approval requests.",
                                 registry=r)
        self.compactions = Counter("corral_compactions", "Context compactions committed.",
                                   registry=r)
        self.call_failures = Counter("corral_request_failures", "Broker requests of the "
                                     "supervisor that failed, by service and kind "
                                     "(worker_lost: a worker died mid-call).",
                                     ["service", "kind"], registry=r)
        self.commit_latency = Histogram("corral_store_commit_seconds",
                                        "Latency of one durable step commit.",
                                        buckets=_FAST_BUCKETS, registry=r)
        self._turn_started: OrderedDict[str, float] = OrderedDict()

    # -------------------------------------------------------------- observed

    def committed(self, events: list[EventRecord], seconds: float) -> None:
        self.commit_latency.observe(seconds)
        for record in events:
            self._event(record)

    def _event(self, record: EventRecord) -> None:
        p = record.payload
        t = record.type
        if t == ev.TURN_STARTED:
            self.turns_started.inc()
            self._turn_started[str(p.get("turn_id"))] = record.created_at
            while len(self._turn_started) > MAX_OPEN_TURNS:
                self._turn_started.popitem(last=False)
        elif t in ev.TERMINAL_TURN_TYPES:
            reason = "completed" if t == ev.TURN_COMPLETE else p.get("reason")
            self.turns_ended.labels(self.reason(reason)).inc()
            started = self._turn_started.pop(str(p.get("turn_id")), None)
            if started is not None:
                self.turn_duration.observe(max(0.0, record.created_at - started))
        elif t == ev.TOOL_CALL_END:
            isolation = p.get("isolation")
            tier = isolation.get("tier") if isinstance(isolation, dict) else None
            tool = self.tool(p.get("name"))
            self.tool_calls.labels(tool, self.outcome(p.get("outcome")), self.tier(tier)).inc()
            duration = p.get("duration_s")
            if isinstance(duration, int | float) and duration >= 0:
                self.tool_duration.labels(tool).observe(float(duration))
        elif t == ev.EXEC_APPROVAL_REQUEST:
            self.approvals.inc()
        elif t == ev.CONTEXT_COMPACTED:
            self.compactions.inc()

    def model_call(self, route: str, outcome: str, ttft_s: float | None, duration_s: float,
                   usage: dict[str, Any] | None) -> None:
        label = self.route(route)
        self.model_calls.labels(label, self.outcome(outcome)).inc()
        self.model_duration.labels(label).observe(duration_s)
        if ttft_s is not None:
            self.model_ttft.labels(label).observe(ttft_s)
        for key in ("input", "cached_input", "output", "reasoning_output"):
            value = (usage or {}).get(key)
            if isinstance(value, int) and value > 0:
                self.tokens.labels(label, key).inc(value)

    def request_failed(self, service: str, kind: str) -> None:
        self.call_failures.labels(self.outcome(service), self.outcome(kind)).inc()

    def begin(self, service: str, payload: dict[str, Any]) -> _CallFigures:
        route = payload.get("route") if service == "model" else None
        name = route.get("name") if isinstance(route, dict) else None
        return _CallFigures(self, service, str(name) if name is not None else None)


class _CallFigures:
    """One request's figures (``hub.CallSink``); model calls by route."""

    trace: str | None = None

    def __init__(self, metrics: FarmMetrics, service: str, route: str | None) -> None:
        self.metrics = metrics
        self.service = service
        self.route = route
        self.ttft_s: float | None = None

    def first_partial(self, ttft_s: float) -> None:
        self.ttft_s = ttft_s

    def end(self, reply: Any, failure: Failure | None, duration_s: float) -> None:
        if failure is not None:
            self.metrics.request_failed(self.service, failure.kind)
        if self.route is None:
            return
        usage = reply.get("usage") if isinstance(reply, dict) else None
        self.metrics.model_call(self.route, "ok" if failure is None else failure.kind,
                                self.ttft_s, duration_s,
                                usage if isinstance(usage, dict) else None)


class FarmCollector(Collector):
    """The figures read at scrape time from one snapshot taken on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, snapshot: Snapshot,
                 farm_json: Path | None) -> None:
        self.loop = loop
        self.snapshot = snapshot
        self.farm_json = farm_json
        # ``corral chaos`` keeps its injected faults by kind beside farm.json.
        self.chaos_json = farm_json.with_name(CHAOS_FAULTS_FILE) if farm_json else None
        self.host = Bounded(64)
        self._service = Bounded(16)
        self.kind = Bounded(32)

    @staticmethod
    def dropped_spans() -> int:
        from broker import otel  # standard library only: no SDK import

        return otel.dropped_spans()

    def service(self, name: object) -> str:
        """The ``service`` label: ``model``, ``tool``, ``tool_pinned`` (the
        workers' own names), ``tool_image`` (the image services), never an id."""
        text = str(name)
        if text.startswith("tool@img-"):
            return IMAGE_SERVICE
        if text.startswith("tool@"):
            return PINNED_SERVICE
        return self._service(text)

    def describe(self) -> list[Metric]:
        return []  # collected per scrape; no fixed description needed

    def collect(self) -> Iterator[Metric]:
        snap: dict[str, Any] = {}
        try:
            fut = asyncio.run_coroutine_threadsafe(self.snapshot(), self.loop)
            snap = fut.result(SNAPSHOT_TIMEOUT_S)
        except (concurrent.futures.TimeoutError, RuntimeError) as exc:
            log.warning("metrics snapshot failed: %s", exc)
        sessions = snap.get("sessions") or {}
        yield from self._sessions(sessions)
        broker = snap.get("broker")
        up = GaugeMetricFamily("corral_broker_up", "1 if the broker answered STATUS "
                               "for this scrape.")
        up.add_metric([], 1.0 if isinstance(broker, dict) and "error" not in broker else 0.0)
        yield up
        if isinstance(broker, dict) and "error" not in broker:
            yield from self._broker(broker)
        yield from self._restarts()
        dropped = CounterMetricFamily("corral_trace_spans_dropped", "Spans the "
                                      "supervisor's trace exporter dropped, its queue "
                                      "full (the OTLP collector down or slow).")
        dropped.add_metric([], float(self.dropped_spans()))
        yield dropped

    def _sessions(self, s: dict[str, Any]) -> Iterator[Metric]:
        g = GaugeMetricFamily("corral_sessions", "Sessions loaded in the supervisor, by "
                              "state (active: working; idle; closed).", labels=["state"])
        for state in ("active", "idle", "closed"):
            g.add_metric([state], float(s.get(f"sessions_{state}", 0)))
        yield g
        for name, key, doc in (
                ("corral_approvals_pending", "pending_approvals", "Approvals waiting for "
                 "an answer."),
                ("corral_turns_running", "turns_running", "Turns in progress."),
                ("corral_inputs_queued", "queued_inputs", "User inputs queued behind a turn."),
                ("corral_sessions_paused_store", "sessions_paused_store", "Sessions whose "
                 "work waits for an unreachable store (docs/storage.md)."),
                ("corral_supervisor_loop_lag_seconds", "loop_lag_s", "The supervisor's "
                 "event loop lag, last measured.")):
            gauge = GaugeMetricFamily(name, doc)
            gauge.add_metric([], float(s.get(key, 0) or 0))
            yield gauge

    def _broker(self, b: dict[str, Any]) -> Iterator[Metric]:
        workers = GaugeMetricFamily("corral_workers", "Workers registered with the broker, "
                                    "by service and host.", labels=["service", "host"])
        slots = GaugeMetricFamily("corral_worker_slots", "Worker slots by service, host "
                                  "and state (busy, idle).", labels=["service", "host", "state"])
        seen_w: dict[tuple[str, str], float] = {}
        seen_s: dict[tuple[str, str, str], float] = {}
        for service, entry in (b.get("workers") or {}).items():
            svc = self.service(service)
            for w in entry.get("workers", []) if isinstance(entry, dict) else []:
                info = w.get("info") if isinstance(w.get("info"), dict) else {}
                host = self.host(info.get("host"))
                cap = float(w.get("capacity", 0) or 0)
                busy = float(w.get("in_flight", 0) or 0)
                seen_w[(svc, host)] = seen_w.get((svc, host), 0) + 1
                for state, n in (("busy", busy), ("idle", max(0.0, cap - busy))):
                    seen_s[(svc, host, state)] = seen_s.get((svc, host, state), 0) + n
        for (svc, host), n in seen_w.items():
            workers.add_metric([svc, host], n)
        for (svc, host, state), n in seen_s.items():
            slots.add_metric([svc, host, state], n)
        yield workers
        yield slots
        queue = GaugeMetricFamily("corral_broker_queue_depth", "Requests queued in the "
                                  "broker, by service.", labels=["service"])
        depths: dict[str, float] = {}  # several services may share a label
        for service, depth in (b.get("queues") or {}).items():
            label = self.service(service)
            depths[label] = depths.get(label, 0.0) + float(depth or 0)
        for label, n in sorted(depths.items()):
            queue.add_metric([label], n)
        yield queue
        counters = b.get("counters") or {}
        for name, key, doc in (
                ("corral_broker_worker_expiries", "worker_expiries", "Workers the broker "
                 "expired (missed heartbeats), since the broker started."),
                ("corral_broker_requests", "requests", "Requests the broker accepted."),
                ("corral_broker_worker_disconnects", "worker_disconnects",
                 "Workers that said DISCONNECT."),
                ("corral_broker_client_restarts", "client_restarts", "Clients seen again "
                 "with a new instance id.")):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(counters.get(key, 0) or 0))
            yield c
        failures = counters.get("failures") or {}
        lost = CounterMetricFamily("corral_worker_lost", "Requests the broker failed with "
                                   "worker_lost (a worker died or vanished mid-request).")
        lost.add_metric([], float(failures.get("worker_lost", 0) or 0))
        yield lost
        fk = CounterMetricFamily("corral_broker_failures", "Requests the broker failed, by "
                                 "kind.", labels=["kind"])
        by_failure: dict[str, float] = {}
        for kind, n in failures.items():
            label = self.kind(kind)
            by_failure[label] = by_failure.get(label, 0.0) + float(n or 0)
        for label, n in sorted(by_failure.items()):
            fk.add_metric([label], n)
        yield fk
        faults = CounterMetricFamily("corral_chaos_faults_injected", "Faults injected under "
                                     "corral chaos, by kind: the broker's frame faults "
                                     "(drop, delay, duplicate) and the harness's timed "
                                     "faults (worker_kill_tool, crash_publish, ...).",
                                     labels=["kind"])
        by_kind: dict[str, float] = {}
        for kind, n in [*(counters.get("faults") or {}).items(), *self._chaos_faults()]:
            label = self.kind(kind)
            by_kind[label] = by_kind.get(label, 0.0) + float(n or 0)
        for label, n in sorted(by_kind.items()):
            faults.add_metric([label], n)
        yield faults

    def _chaos_faults(self) -> list[tuple[str, float]]:
        """The harness's injected faults by kind (``CHAOS_FAULTS_FILE``); none
        outside a chaos run or when the file is unreadable."""
        if self.chaos_json is None:
            return []
        try:
            data = json.loads(self.chaos_json.read_text())
        except (OSError, ValueError):
            return []
        faults = data.get("faults") if isinstance(data, dict) else None
        if not isinstance(faults, dict):
            return []
        return [(str(k), float(v)) for k, v in list(faults.items())[:64]
                if isinstance(v, int | float) and not isinstance(v, bool) and v >= 0]

    def _restarts(self) -> Iterator[Metric]:
        c = CounterMetricFamily("corral_process_restarts", "Farm processes restarted by the "
                                "farm's root, by role.", labels=["role"])
        data: Any = None
        if self.farm_json is not None:
            try:
                data = json.loads(self.farm_json.read_text())
            except (OSError, ValueError):
                data = None
        by_role: dict[str, float] = {}
        for child in (data or {}).get("children", []) if isinstance(data, dict) else []:
            match = _ROLE.match(str(child.get("name", "")))
            role = self.kind(match.group(1) if match else "other")
            by_role[role] = by_role.get(role, 0) + float(child.get("restarts", 0) or 0)
        for role, n in sorted(by_role.items()):
            c.add_metric([role], n)
        yield c
