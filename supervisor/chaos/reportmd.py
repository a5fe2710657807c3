"""Render a ``corral chaos --json`` report as ``docs/chaos-report.md``.

``python -m supervisor.chaos.reportmd RUN.json "COMMAND" > docs/chaos-report.md``
reads the report (the first line of the run's standard output) and writes
every figure from it: per-kind fault counts (timed faults as injected, frame
faults from the broker's counters, provider faults as served), recovery p50
and p99 per kind, turns, tool calls, exports verified, the sustained fault
rate and what bounded it (the run's phases, the CPU it used, the host's load).

Invariant: every number printed is read from the report; nothing is typed in.
"""

from __future__ import annotations

import json
import sys
from typing import Any

FRAME_KINDS = {"drop": "frame_drop", "delay": "frame_delay", "duplicate": "frame_duplicate"}


def _s(v: Any) -> str:
    return "-" if v is None else f"{v} s"


def render(r: dict[str, Any], command: str) -> str:
    c = r["counts"]
    by_kind = r.get("faults_by_kind", {})
    frame = ((r.get("continuous_faults") or {}).get("frame") or {}).get("total") or {}
    provider = r.get("provider_faults_in_script") or {}
    timed = sum(k["injected"] for k in by_kind.values())
    frames = sum(int(v) for v in frame.values())
    served = sum(int(v) for v in provider.values())
    total = timed + frames + served
    duration = float(r.get("duration_s") or 0) or 1.0
    phases = r.get("phases_s", {})
    host = r.get("host", {})
    out = [
        "# Chaos report: the hour-long soak", "",
        f"Produced by `{command}` on the shared 2-core machine while other engineers "
        "ran their tests; every figure below is copied from the run's JSON report "
        "(rendered by `python -m supervisor.chaos.reportmd`). How faults are aimed, "
        "what each invariant reads and how recovery is measured: `docs/chaos.md`.", "",
        "| | |", "|---|---|",
        f"| seed | {r['seed']} |",
        f"| violations | **{len(r['violations'])}** |",
        f"| fault phase | {r.get('duration_s')} s |",
        f"| elapsed (start-up, faults, final turns, checks) | {r['elapsed_s']} s |",
        f"| faults injected, all kinds | **{total}** ({timed} timed, {frames} frame, "
        f"{served} provider) |",
        f"| sustained fault rate | {total / duration:.2f} faults/s over the fault phase |",
        f"| sessions (final turn ok) | {c['sessions']} ({c['sessions_final_turn_ok']}) |",
        f"| turns | {c['turns']} |",
        f"| tool calls | {c['tool_calls']} |",
        f"| exports verified (each also tampered with, per section) | "
        f"{c['exports_verified']}"
        + (f" (an even sample of the {c['exports_seen']} the run wrote, plus each "
           "session's last)" if c.get("exports_seen") else "") + " |",
        f"| calls on killed workers checked (unknown + worker_lost in bound) | "
        f"{(c.get('killed_calls') or {}).get('checked', 0)} "
        f"({json.dumps(c.get('killed_calls') or {})}) |",
        f"| repeated requests | {c['repeated_requests']} |",
        f"| compactions; approvals requested, answered by the harness | "
        f"{c.get('compactions', '-')}; {c.get('approvals_requested', '-')}, "
        f"{c.get('approvals_answered', '-')} |",
        f"| sessions by role | {json.dumps(c.get('sessions_by_role') or {})} |",
        f"| process-table samples | {c.get('process_table_samples')} |",
        f"| checks | {', '.join(r['checks'])} |",
        "",
        "## Faults and recovery by kind", "",
        "Recovery: from the fault to the affected session's next progress event "
        "(`docs/chaos.md`, Recovery).", "",
        "Hit: the fault landed in its window (a crash point reached and claimed, a tool "
        "kill with the call's processes in the worker's cgroup, ...).", "",
        "| kind | injected | hit | skipped (retried) | sessions measured | recovery p50 | p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind, k in sorted(by_kind.items()):
        rec = k.get("recovery") or {}
        out.append(f"| {kind} | {k['injected']} | {k.get('hit', '-')} | {k['skipped']} | "
                   f"{rec.get('count', 0)} | {_s(rec.get('p50_s'))} | {_s(rec.get('p99_s'))} |")
    for key, kind in FRAME_KINDS.items():
        if key in frame:
            out.append(f"| {kind} | {frame[key]} | - | - | - | - | - |")
    for kind, n in sorted(provider.items()):
        out.append(f"| {kind} | {n} | - | - | - | - | - |")
    out += [
        "",
        "Frame faults are counted by the broker (polled every second, summed across "
        "broker restarts: a lower bound); provider faults are the script's faulty "
        "entries each session reached (first attempts). Neither is timed, so their "
        "recovery is the caller's retry, not measured per fault.", "",
        "## Recovery by process group", "",
        "| group | sessions measured | p50 | p99 | max | unrecovered |",
        "|---|---|---|---|---|---|",
    ]
    for group, g in sorted(r.get("recovery", {}).items()):
        out.append(f"| {group} | {g['count']} | {_s(g['p50_s'])} | {_s(g['p99_s'])} | "
                   f"{_s(g['max_s'])} | {g['unrecovered']} |")
    restarts = sum(k["injected"] for kind, k in by_kind.items()
                   if kind == "supervisor_kill" or kind.startswith("crash_"))
    sup = (r.get("recovery") or {}).get("supervisor") or {}
    down = restarts * float(sup.get("p50_s") or 0.0)
    out += [
        "", "## What bounded the rate", "",
        f"Three sources add up: timed faults ({timed}, one every {duration / max(1, timed):.1f} s: "
        "the gap is bounded below so each recovery can be measured on its own), frame "
        f"faults ({frames}: a share of the request traffic) and provider faults ({served}: a "
        "share of the model calls). The last two scale with the traffic the farm carries, "
        f"and the traffic is bounded by the supervisor's restarts: {restarts} of the timed "
        "faults kill the supervisor (`supervisor_kill` and the `crash_*` kinds), each "
        f"costing the sessions about {sup.get('p50_s')} s (recovery p50), about "
        f"{down:.0f} s of {duration:.0f} s in all; and by the CPU: 2 cores shared with "
        "other engineers' test runs (load below).",
        "",
        f"Phases (wall seconds): {json.dumps(phases)}. Host: {host.get('cpus')} cores, "
        f"load average {host.get('loadavg_start')} at the start and "
        f"{host.get('loadavg_end')} at the end"
        + (f", 1-minute load while the farm ran {json.dumps(host['loadavg_1m_during'])}"
           if host.get("loadavg_1m_during") else "")
        + f"; the run (this harness and the farm it "
        f"started) used {host.get('cpu_s')} CPU seconds, "
        f"{(host.get('cpu_s') or 0) / max(1.0, float(r['elapsed_s'])):.2f} cores on "
        "average.", "",
    ]
    if r["violations"]:
        out += ["## Violations", ""]
        out += [f"- `{v['invariant']}` session {v['session_id']} seq {v['sequence']}: "
                f"{v['detail']}" for v in r["violations"][:50]]
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        report = json.loads(f.readline())
    command = argv[1] if len(argv) > 1 else "corral chaos --json"
    sys.stdout.write(render(report, command))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
