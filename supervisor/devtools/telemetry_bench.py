"""``scripts/bench telemetry``: what telemetry costs the supervisor per turn.

The events and requests of one realistic turn (turn start, two model steps,
one tool call with its hook, turn end) are fed to the supervisor's telemetry
hub (``supervisor.telemetry.hub.Telemetry``) with each configuration in turn,
alternated round by round in the same run so the machine's load drifts
evenly over all of them:

- ``off``: the hub with no sink (what the engine pays when telemetry is off
  is not even this: it holds no hub at all);
- ``metrics``: ``FarmMetrics`` (prometheus-client);
- ``traces``: ``SupervisorTracer``, every turn sampled, the spans encoded to
  OTLP protobuf by the batching processor's thread (no network);
- ``traces_unsampled``: the same with ``OTEL_TRACES_SAMPLER=traceidratio`` at
  0 (every turn sampled out);
- ``both``: metrics and sampled traces;
- ``both_sampled_10pct``: metrics and traces with one turn in ten sampled
  (``parentbased_traceidratio`` at 0.1).

Reported per configuration: the CPU per turn of the calling thread (the
engine's loop) and of the whole process (the exporter's thread included), in
milliseconds, and the added CPU against ``off``. Compare only within a run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from supervisor.store.records import EventRecord, SessionId, StepWrite
from supervisor.telemetry.hub import Telemetry

CONFIGS = ("off", "metrics", "traces", "traces_unsampled", "both", "both_sampled_10pct")


class _EncodingExporter:
    """Encodes each batch to OTLP protobuf, as the HTTP exporter does, and
    drops it (the cost without the network)."""

    def export(self, spans: Any) -> Any:
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
        from opentelemetry.sdk.trace.export import SpanExportResult

        encode_spans(spans).SerializeToString()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _tracer(ratio: float) -> Any:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    from supervisor.telemetry.tracing import SupervisorTracer

    provider = TracerProvider(resource=Resource.create({"service.name": "corral-supervisor"}),
                              sampler=ParentBased(TraceIdRatioBased(ratio)))
    provider.add_span_processor(BatchSpanProcessor(_EncodingExporter()))  # type: ignore[arg-type]
    return SupervisorTracer(provider=provider)


def _hub(config: str) -> tuple[Telemetry, Callable[[], None]]:
    sinks: list[Any] = []
    stops: list[Callable[[], None]] = []
    if config in ("metrics", "both", "both_sampled_10pct"):
        from supervisor.telemetry.metrics import FarmMetrics

        sinks.append(FarmMetrics())
    if config in ("traces", "traces_unsampled", "both", "both_sampled_10pct"):
        tracer = _tracer({"traces_unsampled": 0.0, "both_sampled_10pct": 0.1}.get(config, 1.0))
        sinks.append(tracer)
        stops.append(tracer.provider.force_flush)
        stops.append(tracer.shutdown)

    def stop() -> None:
        for fn in stops:
            fn()
    return Telemetry(sinks), stop


def _step(sid: str, seq: int, type_: str, **payload: Any) -> StepWrite:
    return StepWrite(session_id=SessionId(sid), events=[EventRecord(
        SessionId(sid), seq, type_, payload, None, time.time())])


def one_turn(hub: Telemetry, n: int) -> None:
    """The telemetry calls of one turn (as the engine makes them)."""
    sid, turn = f"sess_{n % 100}", f"turn_{n}"
    route = {"name": "main", "provider": "openai-responses", "model": "scripted"}
    hub.committed(_step(sid, 1, "turn_started", turn_id=turn), 0.001)
    for step in range(2):
        watch = hub.begin("model", {"session_id": sid, "route": route, "items": []})
        watch.first_partial()
        watch.end({"usage": {"input": 20, "output": 5}, "model": "scripted",
                   "stop_reason": "tool_use" if step == 0 else "end_turn"}, None)
        if step == 0:
            call = f"call_{n}"
            hub.committed(_step(sid, 2, "tool_call_begin", turn_id=turn, call_id=call,
                                name="shell"), 0.001)
            watch = hub.begin("tool", {"call_id": call, "tool": "shell"})
            watch.end({"outcome": "ok"}, None)
            hub.committed(_step(sid, 3, "tool_call_end", turn_id=turn, call_id=call,
                                name="shell", outcome="ok", duration_s=0.01,
                                isolation={"tier": "T2"}), 0.001)
    hub.committed(_step(sid, 4, "turn_complete", turn_id=turn), 0.001)


def measure(config: str, turns: int) -> dict[str, float]:
    hub, stop = _hub(config)
    one_turn(hub, -1)  # warm-up: imports, first series
    wall0, thread0, proc0 = time.perf_counter(), time.thread_time(), time.process_time()
    for n in range(turns):
        one_turn(hub, n)
    thread_s = time.thread_time() - thread0
    stop()  # the exporter's thread finishes its batches: counted in the process CPU
    proc_s = time.process_time() - proc0
    return {"thread_ms_per_turn": thread_s * 1000 / turns,
            "process_ms_per_turn": proc_s * 1000 / turns,
            "wall_ms_per_turn": (time.perf_counter() - wall0) * 1000 / turns}


def bench(turns: int, rounds: int) -> dict[str, Any]:
    samples: dict[str, list[dict[str, float]]] = {c: [] for c in CONFIGS}
    for _ in range(rounds):  # alternated: each round runs every configuration once
        for config in CONFIGS:
            samples[config].append(measure(config, turns))
    out: dict[str, Any] = {}
    for config, runs in samples.items():
        out[config] = {key: round(statistics.median(r[key] for r in runs), 4)
                       for key in runs[0]}
    for config in CONFIGS[1:]:
        for key in ("thread_ms_per_turn", "process_ms_per_turn"):
            out[config][f"added_{key}"] = round(out[config][key] - out["off"][key], 4)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m supervisor.devtools.telemetry_bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer turns, under 30 s")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--turns", type=int, default=0, help="turns per configuration run")
    parser.add_argument("--rounds", type=int, default=0, help="alternated rounds")
    args = parser.parse_args(argv)
    turns = args.turns or (300 if args.quick else 2000)
    rounds = args.rounds or (3 if args.quick else 5)
    results = bench(turns, rounds)
    doc = {"name": "telemetry", "loadavg": [round(x, 2) for x in os.getloadavg()],
           "turns": turns, "rounds": rounds, "results": results}
    if args.json:
        print(json.dumps(doc, sort_keys=True))
        return 0
    print(f"{'config':<18} {'thread ms/turn':>14} {'process ms/turn':>15} {'added (proc)':>12}")
    for config, r in results.items():
        print(f"{config:<18} {r['thread_ms_per_turn']:>14.3f} {r['process_ms_per_turn']:>15.3f} "
              f"{r.get('added_process_ms_per_turn', 0.0):>12.3f}")
    print(f"load average {doc['loadavg']}, {turns} turns x {rounds} alternated rounds")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
