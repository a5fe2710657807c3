"""Takeover benchmark: ``python -m supervisor.devtools.takeover_bench [--sessions K] [--json]``
(also ``scripts/bench sessions --takeover``).

``takeover_s``: from a supervisor's SIGKILL to its sessions' next progress on another
supervisor of the same PostgreSQL store, p50 and p99 over K sessions. Issue 19's target:
p99 ≤ lease + 1 s.

Set-up, all real processes: a throwaway PostgreSQL cluster (``devtools.pgserver``), a farm
of one supervisor (A; ``corral up --detach`` machinery: broker, workers, the scripted
provider) on it, and a second supervisor B (``python -m supervisor --supervisor-id
bench-b``, not a child of the farm's tree, so nothing restarts it). K sessions are created
on B (``placed``: kept there) and each runs a turn of many short sandboxed tool calls.
Once every session has progressed, B is SIGKILLed; the time of each session's first
durable event after its last one before the kill is its takeover time (polled every
50 ms from PostgreSQL directly, in one query). After a takeover the in-flight tool
call is reported ``unknown`` and the turn goes on, so that event comes from A.

Invariants: every child is killed and reaped by pid on exit (B by the bench, the farm by
``stop_detached``, PostgreSQL by ``PgServer.stop``); every wait has a deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from supervisor.client import SupervisorClient
from supervisor.devtools.pgserver import PgServer
from supervisor.farm.layout import FarmPaths
from supervisor.farm.root import start_detached, stop_detached


def _home(home: Path, url: str, lease_s: float, calls: int) -> None:
    home.mkdir(parents=True, exist_ok=True)
    tool = {"tool_calls": [{"name": "shell", "arguments": {"command": "sleep 0.2"}}]}
    script = {"responses": [tool] * calls + [{"text": "done",
                                              "usage": {"input": 1, "output": 1}}]}
    (home / "script.json").write_text(json.dumps(script))
    (home / "corral.toml").write_text(
        '[session]\ndefault_route = "s"\napproval = "allow"\nmax_model_steps = 1000\n'
        '[routes.s]\nscript = "script.json"\nread_timeout_s = 10.0\n'
        f'[store]\nurl = "{url}"\nlease_s = {lease_s}\n')


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def _last_sequences(db: Any, sids: list[str]) -> dict[str, int]:
    """Each session's last durable sequence, read from PostgreSQL directly (one query; a
    poll through supervisor A would compete with A's own resume for its reader)."""
    cur = await db.execute(
        "SELECT s.session_id, COALESCE(max(e.sequence), 0) FROM sessions s"
        " LEFT JOIN events e ON e.sid = s.sid WHERE s.session_id = ANY(%s)"
        " GROUP BY s.session_id", (sids,))
    return {str(r[0]): int(r[1]) for r in await cur.fetchall()}


async def _measure(url: str, b_endpoint: str, b_pid: int, root: Path,
                   sessions: int, lease_s: float) -> list[float]:
    import psycopg

    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as db, \
            SupervisorClient(b_endpoint) as b:
        sids = []
        for i in range(sessions):
            ws = root / f"ws{i}"
            ws.mkdir()
            ws.chmod(0o777)  # the sandbox uid writes here
            sid = str(await b.call("create_session", spec={"workspace": str(ws)},
                                   placed=True))
            await b.submit(sid, {"type": "user_input", "text": "go"})
            sids.append(sid)
        deadline = time.monotonic() + 120
        while True:  # every session has run a tool call on B
            cur = await db.execute(
                "SELECT count(DISTINCT s.session_id) FROM sessions s JOIN events e"
                " ON e.sid = s.sid WHERE e.type = 'tool_call_end'"
                " AND s.session_id = ANY(%s)", (sids,))
            row = await cur.fetchone()
            started = [True] * int(row[0] if row else 0)
            started += [False] * (len(sids) - len(started))
            if all(started):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{started.count(False)} sessions never ran a tool call")
            await asyncio.sleep(0.2)
        # Freeze B, read the last sequences, then kill it; the clock starts at the
        # freeze (B's last act), so the reading time counts against the takeover.
        os.kill(b_pid, signal.SIGSTOP)
        killed_at = time.monotonic()
        before = await _last_sequences(db, sids)
        os.kill(b_pid, signal.SIGKILL)
        took: dict[str, float] = {}
        deadline = killed_at + 3 * lease_s + 60
        while len(took) < len(sids):
            now = await _last_sequences(db, sids)
            at = time.monotonic() - killed_at
            for s in sids:
                if s not in took and now[s] > before[s]:
                    took[s] = at
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(sids) - len(took)} sessions made no progress "
                                   f"{deadline - killed_at:.0f}s after the kill")
            await asyncio.sleep(0.05)
        return [took[s] for s in sids]


def run(sessions: int = 20, lease_s: float = 2.0, workers: int = 2) -> dict[str, Any]:
    """One measurement; returns ``{"sessions", "lease_s", "p50", "p99", "max",
    "target_p99", "samples"}`` (seconds)."""
    pg = PgServer.start()
    b_proc: subprocess.Popen[bytes] | None = None
    with tempfile.TemporaryDirectory(prefix="corral-takeover-", dir="/tmp") as tmp:
        root = Path(tmp)
        home = root / "home"
        try:
            url = pg.new_database()
            _home(home, url, lease_s, calls=400)
            info = start_detached(home, workers=workers, timeout_s=120)
            llm = next(c["ready"]["url"] for c in info["children"]
                       if c["name"].startswith("fakellm"))
            _home(root / "home-b", url, lease_s, calls=400)
            b_endpoint = f"ipc://{root}/b.sock"
            b_proc = subprocess.Popen(
                [sys.executable, "-m", "supervisor", "--home", str(root / "home-b"),
                 "--broker", FarmPaths.of(home).broker_frontend, "--listen", b_endpoint,
                 "--route-url", f"s={llm}", "--supervisor-id", "bench-b"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
            assert b_proc.stdout is not None
            line = b_proc.stdout.readline()  # the ready line (the child has a lifeline)
            if not line:
                raise RuntimeError("supervisor B exited before it was ready")
            samples = asyncio.run(_measure(url, b_endpoint, b_proc.pid, root, sessions, lease_s))
        finally:
            if b_proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(b_proc.pid, signal.SIGKILL)
                b_proc.wait(10)
            stop_detached(home)
            pg.stop()
    return {"sessions": sessions, "lease_s": lease_s,
            "p50": round(statistics.median(samples), 3),
            "p99": round(_percentile(samples, 0.99), 3), "max": round(max(samples), 3),
            "target_p99": lease_s + 1.0, "samples": [round(x, 3) for x in sorted(samples)]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m supervisor.devtools.takeover_bench",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=20, help="sessions on the killed one")
    p.add_argument("--lease-s", type=float, default=2.0, help="[store] lease_s of the run")
    p.add_argument("--workers", type=int, default=2, help="sandbox workers of the farm")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    ns = p.parse_args(argv)
    result = run(ns.sessions, ns.lease_s, ns.workers)
    if ns.json:
        print(json.dumps({"takeover_s": result}))
    else:
        print(f"takeover_s over {result['sessions']} sessions, lease {result['lease_s']}s: "
              f"p50 {result['p50']}s, p99 {result['p99']}s, max {result['max']}s "
              f"(target p99 <= {result['target_p99']}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
