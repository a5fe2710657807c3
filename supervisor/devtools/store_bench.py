"""Store benchmark: ``python -m supervisor.devtools.store_bench [--quick] [--json]``.

One session through N model+tool steps (a user message, an assistant function_call, a
function_call_output of 1-2 KB and an assistant message per step, with the events the
engine journals for them: model_step_started, model_step_completed, tool_call_begin,
tool_call_end carrying the output, agent_message, token_count; plus the state row and
the upsert of the turn's execution record, a turn being 5 steps). Each step is one
``Store.commit``.

Measured, in the same run:
- bytes the database grows per step (page_count x page_size, which includes what is
  still in the WAL) against the bytes of new transcript per step (the JSON of the batch's
  items); the whole run's ``write_amplification`` = growth / transcript bytes;
- ``late_vs_early_step_bytes``: growth per step over the last 100 steps / first 100;
- bytes handed to write() by the process (``/proc/self/io`` wchar: WAL frames plus
  checkpoints) per step, i.e. the I/O amplification;
- commits/s and p50/p99 step persistence time (the ``await store.commit``);
- group commit: S concurrent sessions, aggregate commits/s and steps per transaction;
- baseline: the same append-only payloads (items, event payloads) as plain INSERTs into
  a bare table, stdlib sqlite3 in the calling thread, one transaction per step, same
  synchronous setting. Every figure is also given as a ratio to it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sqlite3
import statistics
import string
import tempfile
import time
from contextlib import closing
from pathlib import Path
from typing import Any

from supervisor.store.records import (
    CheckpointState,
    EventRecord,
    ExecutionRecord,
    SessionId,
    SessionRecord,
    StepWrite,
    SubmissionId,
    TranscriptBatch,
    TurnId,
)
from supervisor.store.store import Store

WINDOW = 100
STEPS_PER_TURN = 5  # a turn is several model+tool steps; its execution row is upserted


def _text(rng: random.Random, size: int) -> str:
    words = []
    total = 0
    while total < size:
        w = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
        words.append(w)
        total += len(w) + 1
    return " ".join(words)[:size]


def make_round(n: int, rng: random.Random) -> tuple[list[dict[str, Any]],
                                                     list[tuple[str, dict[str, Any]]]]:
    """The items and events of one model+tool step."""
    call_id = f"call_{n:06d}"
    output = _text(rng, rng.randint(1024, 2048))
    reply = _text(rng, rng.randint(80, 240))
    arguments = json.dumps({"command": f"grep -n {_text(rng, 12)} src/*.py"})
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": _text(rng, rng.randint(40, 160))}]},
        {"type": "function_call", "call_id": call_id, "name": "shell", "arguments": arguments},
        {"type": "function_call_output", "call_id": call_id, "output": output},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": reply}]},
    ]
    usage = {"input": 1200 + n, "cached_input": 1000, "cache_write_input": 0, "output": 60,
             "reasoning_output": 0, "total": 1260 + n}
    turn_id = f"turn_{(n - 1) // STEPS_PER_TURN:06d}"
    events: list[tuple[str, dict[str, Any]]] = [
        ("model_step_started", {"turn_id": turn_id, "step": 1}),
        ("tool_call_begin", {"turn_id": turn_id, "call_id": call_id, "name": "shell",
                             "arguments": arguments}),
        ("tool_call_end", {"turn_id": turn_id, "call_id": call_id, "name": "shell",
                           "output": output, "is_error": False, "outcome": "ok",
                           "exit_code": 0, "duration_s": 0.012}),
        ("model_step_completed", {"turn_id": turn_id, "step": 2, "outcome": "completed",
                                  "diagnostics": {"prompt_cache": {"outcome": "hit"}}}),
        ("agent_message", {"turn_id": turn_id, "text": reply}),
        ("token_count", {"turn_id": turn_id, "last": usage}),
    ]
    return items, events


class _Steps:
    """Builds the StepWrites of one session (sequences, state, execution)."""

    def __init__(self, session_id: str, seed: int) -> None:
        self.sid = SessionId(session_id)
        self.rng = random.Random(seed)
        self.state = CheckpointState(route="main")
        self.transcript_bytes = 0

    def next(self, n: int) -> tuple[StepWrite, list[dict[str, Any]], list[tuple[str, Any]]]:
        items, event_specs = make_round(n, self.rng)
        st = self.state
        events = []
        for typ, payload in event_specs:
            events.append(EventRecord(self.sid, st.next_event_sequence, typ, payload,
                                      SubmissionId(f"sub_{(n - 1) // STEPS_PER_TURN:06d}"),
                                      time.time()))
            st.next_event_sequence += 1
        batch = TranscriptBatch(self.sid, st.next_batch_sequence, st.context_epoch, items,
                                time.time())
        st.next_batch_sequence += 1
        turn = (n - 1) // STEPS_PER_TURN
        st.active_turn = {"turn_id": f"turn_{turn:06d}", "submission_id": f"sub_{turn:06d}",
                          "phase": "preparing", "model_steps": 2, "started_at": time.time()}
        st.last_usage = dict(event_specs[-1][1]["last"])
        st.total_usage = {k: st.total_usage.get(k, 0) + v for k, v in st.last_usage.items()}
        last = n % STEPS_PER_TURN == 0
        execution = ExecutionRecord(self.sid, TurnId(f"turn_{turn:06d}"),
                                    "completed" if last else "running",
                                    2 * (n - turn * STEPS_PER_TURN), n - turn * STEPS_PER_TURN,
                                    0, st.last_usage, time.time(),
                                    time.time() if last else None, 0.05 if last else None,
                                    "T2", None)
        self.transcript_bytes += len(json.dumps(items, separators=(",", ":"),
                                                ensure_ascii=False).encode())
        step = StepWrite(self.sid, events, batch, None,
                         CheckpointState.from_json(st.to_json()), execution)
        return step, items, event_specs


def _page_bytes(conn: sqlite3.Connection) -> int:
    page_count = conn.execute("PRAGMA page_count").fetchone()[0]
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    return int(page_count) * int(page_size)


def _wchar() -> int:
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(latencies_s: list[float], wall_s: float, sizes: list[int],
             transcript: int, written: int, steps: int) -> dict[str, Any]:
    growth = sizes[-1] - sizes[0]
    early = (sizes[WINDOW] - sizes[0]) / WINDOW
    late = (sizes[-1] - sizes[-1 - WINDOW]) / WINDOW
    return {
        "steps": steps,
        "transcript_bytes_per_step": round(transcript / steps, 1),
        "db_bytes_per_step": round(growth / steps, 1),
        "db_bytes_per_step_first_100": round(early, 1),
        "db_bytes_per_step_last_100": round(late, 1),
        "io_bytes_per_step": round(written / steps, 1),
        "write_amplification": round(growth / transcript, 3),
        "io_amplification": round(written / transcript, 3),
        "commits_per_s": round(steps / wall_s, 1),
        "p50_commit_ms": round(statistics.median(latencies_s) * 1000, 3),
        "p99_commit_ms": round(_percentile(latencies_s, 0.99) * 1000, 3),
    }


async def run_store(path: Path, steps: int, synchronous: str) -> dict[str, Any]:
    store = await Store.open(path, synchronous=synchronous)
    try:
        gen = _Steps("bench-session", seed=7)
        await store.create_session(SessionRecord(gen.sid, time.time(),
                                                 {"route": "main", "workspace": "/ws"}))
        with closing(sqlite3.connect(path)) as probe:
            sizes = [_page_bytes(probe)]
            latencies: list[float] = []
            written = 0
            wall = 0.0
            for n in range(1, steps + 1):
                step, _, _ = gen.next(n)
                w0 = _wchar()
                t0 = time.perf_counter()
                await store.commit(step)
                dt = time.perf_counter() - t0
                written += _wchar() - w0
                latencies.append(dt)
                wall += dt
                sizes.append(_page_bytes(probe))
        return _summary(latencies, wall, sizes, gen.transcript_bytes, written, steps)
    finally:
        await store.close()


def run_baseline(path: Path, steps: int, synchronous: str) -> dict[str, Any]:
    gen = _Steps("bench-session", seed=7)
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute(f"PRAGMA synchronous = {synchronous}")
        conn.execute("CREATE TABLE bare (id INTEGER PRIMARY KEY, data TEXT NOT NULL)")
        sizes = [_page_bytes(conn)]
        latencies: list[float] = []
        written = 0
        wall = 0.0
        for n in range(1, steps + 1):
            _, items, events = gen.next(n)
            rows = [(json.dumps(items, separators=(",", ":"), ensure_ascii=False),)]
            rows += [(json.dumps(p, separators=(",", ":"), ensure_ascii=False),)
                     for _, p in events]
            w0 = _wchar()
            t0 = time.perf_counter()
            conn.execute("BEGIN")
            conn.executemany("INSERT INTO bare (data) VALUES (?)", rows)
            conn.execute("COMMIT")
            dt = time.perf_counter() - t0
            written += _wchar() - w0
            latencies.append(dt)
            wall += dt
            sizes.append(_page_bytes(conn))
    return _summary(latencies, wall, sizes, gen.transcript_bytes, written, steps)


async def run_group(path: Path, sessions: int, steps: int, synchronous: str) -> dict[str, Any]:
    store = await Store.open(path, synchronous=synchronous)
    try:
        gens = [_Steps(f"s{i:03d}", seed=i) for i in range(sessions)]
        for g in gens:
            await store.create_session(SessionRecord(g.sid, time.time(), {"route": "main"}))
        prepared = [[g.next(n)[0] for n in range(1, steps + 1)] for g in gens]
        groups0, ops0 = store.groups_committed, store.ops_committed
        latencies: list[float] = []

        async def drive(batch: list[StepWrite]) -> None:
            for step in batch:
                t0 = time.perf_counter()
                await store.commit(step)
                latencies.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        async with asyncio.TaskGroup() as tg:
            for batch in prepared:
                tg.create_task(drive(batch))
        wall = time.perf_counter() - t0
        total = sessions * steps
        groups = store.groups_committed - groups0
        return {
            "sessions": sessions,
            "steps": total,
            "commits_per_s": round(total / wall, 1),
            "steps_per_transaction": round((store.ops_committed - ops0) / max(groups, 1), 2),
            "p50_commit_ms": round(statistics.median(latencies) * 1000, 3),
            "p99_commit_ms": round(_percentile(latencies, 0.99) * 1000, 3),
        }
    finally:
        await store.close()


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "sqlite": sqlite3.sqlite_version,
            "loadavg": [round(x, 2) for x in os.getloadavg()]}


async def run(quick: bool, directory: str | None) -> dict[str, Any]:
    steps = 300 if quick else 1000
    sessions, group_steps = (16, 20) if quick else (32, 50)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="corral-store-bench-", dir=directory) as tmp:
        d = Path(tmp)
        results["baseline_normal"] = run_baseline(d / "baseline.db", steps, "NORMAL")
        results["store_normal"] = await run_store(d / "store.db", steps, "NORMAL")
        results["group_normal"] = await run_group(d / "group.db", sessions, group_steps,
                                                  "NORMAL")
        if not quick:
            results["baseline_full"] = run_baseline(d / "baseline-full.db", steps, "FULL")
            results["store_full"] = await run_store(d / "store-full.db", steps, "FULL")
            results["group_full"] = await run_group(d / "group-full.db", sessions,
                                                    group_steps, "FULL")
    s, b, g = results["store_normal"], results["baseline_normal"], results["group_normal"]
    ratios = {
        "write_amplification": s["write_amplification"],
        "late_vs_early_step_bytes": round(s["db_bytes_per_step_last_100"]
                                          / s["db_bytes_per_step_first_100"], 3),
        "db_bytes_vs_baseline": round(s["db_bytes_per_step"] / b["db_bytes_per_step"], 3),
        "io_bytes_vs_baseline": round(s["io_bytes_per_step"] / b["io_bytes_per_step"], 3),
        "commits_per_s_vs_baseline": round(s["commits_per_s"] / b["commits_per_s"], 3),
        "p99_commit_vs_baseline": round(s["p99_commit_ms"] / b["p99_commit_ms"], 3),
        "group_commits_per_s_vs_baseline": round(g["commits_per_s"] / b["commits_per_s"], 3),
    }
    if not quick:
        ratios["store_full_vs_normal_p50"] = round(
            results["store_full"]["p50_commit_ms"] / s["p50_commit_ms"], 3)
        ratios["group_full_vs_single_full_commits_per_s"] = round(
            results["group_full"]["commits_per_s"] / results["store_full"]["commits_per_s"], 3)
    return {"name": "store", "machine": machine(), "results": results, "ratios": ratios,
            "quick": quick}


def print_table(doc: dict[str, Any]) -> None:
    results = doc["results"]
    cols = ["transcript_bytes_per_step", "db_bytes_per_step", "io_bytes_per_step",
            "write_amplification", "commits_per_s", "p50_commit_ms", "p99_commit_ms"]
    print(f"{'run':<16}" + "".join(f"{c[:18]:>20}" for c in cols))
    for name, r in results.items():
        if name.startswith("group"):
            continue
        print(f"{name:<16}" + "".join(f"{r[c]:>20}" for c in cols))
    for name, r in results.items():
        if name.startswith("group"):
            print(f"{name}: {r['sessions']} sessions, {r['commits_per_s']} commits/s, "
                  f"{r['steps_per_transaction']} steps/transaction, p99 {r['p99_commit_ms']} ms")
    print()
    for k, v in doc["ratios"].items():
        print(f"{k:<42}{v:>10}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m supervisor.devtools.store_bench",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a reduced run, under 60 s")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object and write bench-results/store.json")
    parser.add_argument("--dir", help="where to put the temporary databases")
    args = parser.parse_args(argv)
    doc = asyncio.run(run(args.quick, args.dir))
    Path("bench-results").mkdir(exist_ok=True)
    Path("bench-results/store.json").write_text(json.dumps(doc, indent=2) + "\n")
    if args.json:
        print(json.dumps(doc))
    else:
        print_table(doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
