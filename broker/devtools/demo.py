"""The foundation demo: a broker, two echo workers, 1,000 requests, and one
worker SIGKILLed in the middle. ``python -m broker.devtools.demo [--requests N] [--json]``.

Every number printed is counted: requests sent, replies received, requests
that failed with ``worker_lost`` (the killed worker's in-flight ones), and
how many of those succeeded when retried (``attempt`` + 1) on the survivor.

Invariant checked before exiting 0: every request ended exactly once, as a
reply (first try or retry), and nothing was lost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from broker import protocol
from broker.client import BrokerClient
from broker.errors import RequestFailed


async def _spawn(argv: list[str], log: Path) -> tuple[asyncio.subprocess.Process, dict[str, Any]]:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=fd, start_new_session=True)
    finally:
        os.close(fd)
    assert proc.stdout is not None
    async with asyncio.timeout(20):
        line = await proc.stdout.readline()
    ready = json.loads(line) if line else {}
    if ready.get("event") != "ready":
        raise RuntimeError(f"{argv[2]} did not start; see {log}")
    return proc, ready


async def run(requests: int, in_flight: int, kill_at: int, as_json: bool) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="corral-demo-"))
    front, back = f"ipc://{tmp}/front.sock", f"ipc://{tmp}/back.sock"
    py = sys.executable
    procs: list[asyncio.subprocess.Process] = []
    counts: dict[str, float] = {"requests": requests, "replies": 0, "worker_lost": 0,
              "retried_ok": 0,
              "other_failures": 0}
    started = time.monotonic()
    try:
        broker, _ = await _spawn([py, "-m", "broker", "--frontend", front, "--backend", back],
                                 tmp / "broker.log")
        procs.append(broker)
        workers = []
        for i in range(2):
            w, _ready = await _spawn([py, "-m", "broker.echo", "--backend", back,
                                     "--capacity", "8"], tmp / f"worker{i}.log")
            procs.append(w)
            workers.append(w)
        victim = workers[0]
        sem = asyncio.Semaphore(in_flight)
        done = 0
        killed_at: float | None = None

        async with BrokerClient(front) as client:
            async def one(i: int) -> None:
                nonlocal done, killed_at
                body = protocol.pack({"i": i, "sleep_s": 0.002})
                async with sem:
                    for attempt in (1, 2, 3):
                        try:
                            reply = await client.request("echo", body, budget_s=10,
                                                         attempt=attempt)
                        except RequestFailed as exc:
                            if exc.failure.kind == protocol.FailureKind.WORKER_LOST:
                                counts["worker_lost"] += 1
                                continue
                            counts["other_failures"] += 1
                            return
                        if protocol.unpack(reply)["i"] != i:
                            counts["other_failures"] += 1
                            return
                        counts["replies"] += 1
                        if attempt > 1:
                            counts["retried_ok"] += 1
                        break
                    done += 1
                    if done == kill_at and killed_at is None:
                        killed_at = time.monotonic()
                        os.kill(victim.pid, signal.SIGKILL)

            async with asyncio.TaskGroup() as tg:
                for i in range(requests):
                    tg.create_task(one(i))
            status = await client.status()
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            await p.wait()
    counts["elapsed_s"] = round(time.monotonic() - started, 2)
    counts["broker_expired_workers"] = status.get("counters", {}).get("worker_expiries", 0)
    ok = counts["replies"] == requests and counts["other_failures"] == 0
    counts["lost"] = requests - counts["replies"]
    if as_json:
        print(json.dumps({"ok": ok, **counts}, sort_keys=True))
    else:
        print("Corral foundation demo: broker + 2 echo workers, one SIGKILLed mid-run")
        for key in ("requests", "replies", "worker_lost", "retried_ok", "other_failures",
                    "lost", "elapsed_s"):
            print(f"  {key:<16} {counts[key]}")
        print("  result           " + ("every request answered exactly once" if ok
                                       else "FAILED: some requests were not answered"))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m broker.devtools.demo", description=__doc__)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--in-flight", type=int, default=16)
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    return asyncio.run(run(ns.requests, ns.in_flight, ns.requests // 3, ns.json))


if __name__ == "__main__":
    sys.exit(main())
