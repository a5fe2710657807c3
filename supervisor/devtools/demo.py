"""``scripts/demo``: the main job.

An ephemeral farm with the scripted provider runs about 20 sessions whose
agents do real work in the sandbox (create a small Python project, run it,
edit it, read the results). Mid-run a worker, the broker and the supervisor
are each SIGKILLed once. At the end the chaos harness's invariants are
checked and a table is printed; every number in it is counted.

``--no-chaos`` runs the same work without faults; ``--faults`` chooses the
processes to kill (in order, one every 8 s or every ``--fault-gap`` seconds;
``provider_kill`` kills the scripted provider); ``--model PROVIDER:MODEL``
(with ``--base-url``) runs the same sessions against a real provider: the
model then improvises, so the checks that count the script's markers on disk
do not apply and the table says which checks ran; ``--echo`` runs the
foundation demo (broker and echo workers only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from sandbox_worker.api import parse_route
from supervisor.chaos.harness import ChaosOptions, Harness, recovery_group
from supervisor.chaos.schedule import PROCESS_FAULTS, Fault

DEFAULT_FAULTS = "worker_kill_tool,broker_kill,supervisor_kill"
FAULT_GAP_S = 8.0
REAL_MODEL_PROMPT = (
    "Work in the current directory. Step {n}: create app/calc.py with a function "
    "combine(x, y) that returns x + y and prints combine(6, 7) when run; run it with "
    "python3 and save the output to build/out.txt; then append the line 'step {n} done' "
    "to effects.log with the shell tool. Reply with one short sentence when done.")

CALC = '''import sys


def combine(x, y):
    return x + y


if __name__ == "__main__":
    print("result", combine(6, 7))
'''


def _shell(k: int, command: str) -> dict[str, Any]:
    # The marker line makes the effect countable (the harness checks it).
    return {"name": "shell", "arguments": {"command": f"echo m-{k} >> effects.log && {command}"}}


def demo_entry(k: int) -> dict[str, Any]:
    step = k % 5
    usage = {"input": 120 + 10 * k, "output": 30, "cached_input": 80}
    if step == 0:
        calls = [
            {"name": "write_file", "arguments": {"path": "app/calc.py", "content": CALC}},
            {"name": "write_file", "arguments": {"path": "app/README.md",
                                                 "content": "# calc\nAdds two numbers.\n"}},
            _shell(k, "mkdir -p build && ls app"),
        ]
        text = "I'll create a small project."
    elif step == 1:
        calls = [_shell(k, "python3 app/calc.py > build/out.txt; cat build/out.txt")]
        text = "Now I run it."
    elif step == 2:
        calls = [{"name": "edit_file", "arguments": {"path": "app/calc.py", "old": "x + y",
                                                     "new": "x * y"}},
                 _shell(k, "python3 app/calc.py >> build/out.txt; tail -1 build/out.txt")]
        text = "Let me change it to multiply and run it again."
    elif step == 3:
        calls = [{"name": "read_file", "arguments": {"path": "build/out.txt"}},
                 {"name": "list_dir", "arguments": {"path": "app"}},
                 _shell(k, "wc -l app/calc.py build/out.txt")]
        text = "Checking the results."
    else:
        return {"text": "Done: the project is created, run, edited and checked.",
                "usage": usage}
    return {"tool_calls": calls, "text": text, "usage": usage, "chunk_delay_s": 0.005}


def demo_script(turns: int) -> dict[str, Any]:
    return {"responses": [demo_entry(k) for k in range(turns * 5)]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="scripts/demo", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=20, help="sessions to run (default 20)")
    p.add_argument("--workers", type=int, default=3, help="sandbox workers (default 3)")
    p.add_argument("--no-chaos", action="store_true", help="run without killing anything")
    p.add_argument("--fault-gap", type=float, default=FAULT_GAP_S, metavar="S",
                   help=f"seconds between two kills (default {FAULT_GAP_S:.0f}; at least 2: "
                        "each recovery is measured on its own)")
    p.add_argument("--faults", default=DEFAULT_FAULTS,
                   help="processes to SIGKILL, one every --fault-gap seconds in this order "
                   f"(default {DEFAULT_FAULTS}; kinds: {', '.join(PROCESS_FAULTS)})")
    p.add_argument("--model", default=None,
                   help="run against this route instead of the scripted provider, e.g. "
                   "openai-chat:qwen2.5 (with --base-url)")
    p.add_argument("--base-url", default=None,
                   help="the provider's base URL for --model (API key from CORRAL_API_KEY, "
                   "OPENAI_API_KEY or ANTHROPIC_API_KEY)")
    p.add_argument("--home", type=Path, default=None,
                   help="keep the farm's files here (default: a temporary directory)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--echo", action="store_true",
                   help="run the foundation demo instead (broker + echo workers)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    if ns.echo:
        from broker.devtools.demo import main as echo_main

        return echo_main(["--json"] if ns.json else [])
    route = None
    if ns.model:
        try:
            route = dict(parse_route(ns.model, ns.base_url, name="chaos"))
        except ValueError as exc:
            print(f"scripts/demo: {exc}", file=sys.stderr)
            return 2
        if "script" in route:
            print("scripts/demo: --model takes a real PROVIDER:MODEL route (the scripted "
                  "provider is the default)", file=sys.stderr)
            return 2
        route.pop("name", None)
    if ns.fault_gap < 2.0:
        print(f"scripts/demo: --fault-gap {ns.fault_gap:g} is too short; give 2 seconds or "
              "more, so each recovery can be measured on its own", file=sys.stderr)
        return 2
    kinds = [k.strip() for k in ns.faults.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in PROCESS_FAULTS]
    if unknown:
        print(f"scripts/demo: unknown fault(s) {unknown}; choose from "
              f"{', '.join(PROCESS_FAULTS)}", file=sys.stderr)
        return 2
    home = ns.home or Path(tempfile.mkdtemp(prefix="corral-demo-"))
    schedule = [] if ns.no_chaos else [
        Fault(6.0 + ns.fault_gap * i, kind, 0, 2.0 if kind == "worker_hang" else 0.0)
        for i, kind in enumerate(kinds)]
    # Enough scripted turns that every session keeps working through the faults.
    turns = 40
    duration_s = (schedule[-1].at_s + 6.0) if schedule else 4.0
    opts = ChaosOptions(seed=1, duration_s=duration_s,
                        sessions=ns.sessions, workers=ns.workers, faults="process",
                        home=home, schedule=schedule, script=demo_script(turns), turns=turns,
                        route=route, prompt=REAL_MODEL_PROMPT if route else
                        ChaosOptions.prompt)
    if not ns.json:
        print(f"demo: {ns.sessions} sessions on {ns.workers} sandbox workers, farm home {home}",
              file=sys.stderr)
        for f in schedule:
            print(f"demo: will {f.kind} at {f.at_s:.0f} s", file=sys.stderr)
    harness = Harness(opts)
    report = asyncio.run(harness.run()).as_dict()
    export = _verified_export(home)
    report["export"] = export
    report["sandbox_tier"] = _tier(harness)
    if ns.json:
        print(json.dumps(report, sort_keys=True))
    else:
        print(render(report))
    return 0 if not report["violations"] and export.get("ok") else 1


def _verified_export(home: Path) -> dict[str, Any]:
    exports = sorted((home / "exports").glob("*.json"))
    if not exports:
        return {"ok": False, "path": None, "detail": "no checkpoint was exported"}
    path = exports[-1]
    result = subprocess.run([sys.executable, "-m", "supervisor.cli", "verify", str(path)],
                            capture_output=True, text=True, timeout=60)
    return {"ok": result.returncode == 0, "path": str(path),
            "detail": (result.stdout or result.stderr).strip()}


def _tier(harness: Harness) -> str:
    tiers: set[str] = set()
    for run in harness.report.sessions:
        for _, e in run.live:
            tier = (e["payload"].get("isolation") or {}).get("tier")
            if e.get("type") == "tool_call_end" and isinstance(tier, str):
                tiers.add(tier)
    return ",".join(sorted(tiers)) or "unknown"


def render(r: dict[str, Any]) -> str:
    c = r["counts"]
    rows = [
        ("sessions completed", f"{c['sessions_final_turn_ok']} / {c['sessions']}"),
        ("turns", c["turns"]),
        ("tool calls", c["tool_calls"]),
        ("faults injected", ", ".join(f["kind"] + (" (skipped)" if "skipped" in f else "")
                                      for f in r["faults"]) or "none"),
    ]
    for group, rec in r["recovery"].items():
        why = sorted({f.get("explained", "") for f in r["faults"] if "affected" in f
                      and not f["affected"] and recovery_group(f["kind"]) == group} - {""})
        rows.append((f"recovery after {group} kill", f"p50 {rec['p50_s']} s, "
                     f"p99 {rec['p99_s']} s (n={rec['count']})" if rec["count"] else
                     "no session affected: " + ("; ".join(why) or "see the faults")))
    rows += [
        ("violations", len(r["violations"])),
        ("checks applied", ", ".join(r["checks"])),
        ("sandbox tier", r["sandbox_tier"]),
        ("exported checkpoint", r["export"]["path"] or "none"),
        ("corral verify", "ok" if r["export"]["ok"] else f"FAILED {r['export']['detail']}"),
        ("elapsed", f"{r['elapsed_s']} s"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = ["", "Corral demo", "-" * (width + 40)]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    for v in r["violations"][:5]:
        lines.append(f"VIOLATION {v['invariant']} session {v['session_id']} seq "
                     f"{v['sequence']}: {v['detail']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
