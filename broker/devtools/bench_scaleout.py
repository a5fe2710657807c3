"""Does the farm scale out?
``python -m broker.devtools.bench_scaleout [--hosts 1,2] [--quick] [--json]``.

Sandboxed tool calls per second (``shell`` running ``true``) through our
broker over tcp + CURVE, as worker hosts grow from 1 to 2. A "host" is one
``python -m sandbox_worker --services tool`` process with its own allowed key,
pinned to its own core (``taskset -c 0``, ``taskset -c 1``), so each host
brings exactly one core; the client and the broker are not pinned. Each host
count is measured ``--repeat`` times, interleaved; medians reported.

Ratio: ``tool_calls_2hosts_vs_1host`` (ideal 2.0; the broker and the client
share the same two cores here, so less is expected). With ``--json``: one JSON
object, also written to ``bench-results/scaleout.json``.

The broker package never imports ``sandbox_worker``: the worker runs as a
process and the tool-call body is built here as plain msgpack.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Final

import msgpack

from broker.client import BrokerClient
from broker.devtools import bench
from broker.security import CurveClient, read_key_file, write_allowed, write_key_pair

PYTHON: Final = sys.executable
IN_FLIGHT: Final = 16


def _body(workspace: str, i: int) -> bytes:
    return bytes(msgpack.packb({"call_id": f"scale-{i}", "tool": "shell",
                                "arguments": {"command": ["true"]}, "session_id": "scaleout",
                                "workspace": workspace}))


async def _calls(frontend: str, curve: CurveClient, workspace: str, total: int) -> float:
    async with BrokerClient(frontend, curve=curve) as client:
        for i in range(4):  # warm up: the first calls prepare the workspace
            await client.request("tool", _body(workspace, -i - 1), budget_s=60)
        remaining = iter(range(total))
        failed = 0

        async def lane() -> None:
            nonlocal failed
            for i in remaining:
                reply = msgpack.unpackb(await client.request("tool", _body(workspace, i),
                                                             budget_s=60))
                failed += reply.get("outcome") != "ok"

        started = time.perf_counter()
        async with asyncio.TaskGroup() as tg:
            for _ in range(IN_FLIGHT):
                tg.create_task(lane())
        elapsed = time.perf_counter() - started
    if failed:
        raise RuntimeError(f"{failed} of {total} tool calls did not end ok")
    return total / elapsed


def _keys(tmp: Path, hosts: int) -> None:
    for name in ("broker", "client", *(f"host{i}" for i in range(hosts))):
        write_key_pair(tmp, name)
    allow = tmp / "allowed"
    write_allowed(allow, "client", read_key_file(tmp / "client.key").public, role="supervisor")
    for i in range(hosts):
        write_allowed(allow, f"host{i}", read_key_file(tmp / f"host{i}.key").public,
                      role="worker")


def measure(hosts: int, keys: Path, workspace: str, total: int, capacity: int) -> float:
    with ExitStack() as stack:
        ready = stack.enter_context(bench._spawn([
            PYTHON, "-m", "broker", "--frontend", "tcp://127.0.0.1:0",
            "--backend", "tcp://127.0.0.1:0", "--curve-secret", str(keys / "broker.key_secret"),
            "--allow-dir", str(keys / "allowed")]))
        cores = os.sched_getaffinity(0)
        for i in range(hosts):
            core = sorted(cores)[i % len(cores)]
            stack.enter_context(bench._spawn([
                "taskset", "-c", str(core), PYTHON, "-m", "sandbox_worker", "--services",
                "tool", "--broker", str(ready["backend"]), "--capacity", str(capacity),
                "--tier-min", "T1", "--server-key", str(keys / "broker.key"),
                "--key", str(keys / f"host{i}.key_secret"), "--log-level", "WARNING"]))
        curve = CurveClient.from_files(keys / "broker.key", keys / "client.key_secret")
        return asyncio.run(_calls(str(ready["frontend"]), curve, workspace, total))


def run(host_counts: list[int], quick: bool, repeat: int, capacity: int) -> dict[str, Any]:
    total = 150 if quick else 600
    rates: dict[int, list[float]] = {}
    tmp = Path(tempfile.mkdtemp(prefix="corral-bench-scale-", dir="/tmp"))
    workspace = tempfile.mkdtemp(prefix="corral-bench-ws-", dir="/tmp")
    os.chmod(workspace, 0o755)
    try:
        _keys(tmp, max(host_counts))
        for _ in range(repeat):
            for hosts in host_counts:
                rates.setdefault(hosts, []).append(measure(hosts, tmp, workspace, total,
                                                           capacity))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(workspace, ignore_errors=True)
    return {f"{h}_hosts": {"tool_calls_per_s": round(statistics.median(r), 1),
                           "runs": [round(x, 1) for x in r]} for h, r in rates.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m broker.devtools.bench_scaleout",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", default="1,2", help="host counts to measure (default 1,2)")
    parser.add_argument("--quick", action="store_true", help="a reduced run, under 60 s")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeat", type=int, default=0,
                        help="runs per host count (default 1 with --quick, else 3)")
    parser.add_argument("--capacity", type=int, default=4, help="calls at once per host")
    args = parser.parse_args(argv)
    counts = sorted({int(x) for x in args.hosts.split(",") if x.strip()})
    if not counts or min(counts) < 1:
        parser.error("--hosts takes positive counts, e.g. 1,2")
    repeat = args.repeat or (1 if args.quick else 3)
    started = time.monotonic()
    results: dict[str, Any] = run(counts, args.quick, repeat, args.capacity)
    rat: dict[str, float] = {}
    base = results[f"{counts[0]}_hosts"]["tool_calls_per_s"]
    for h in counts[1:]:
        rat[f"tool_calls_{h}hosts_vs_{counts[0]}host"] = round(
            results[f"{h}_hosts"]["tool_calls_per_s"] / base, 3)
    results["seconds"] = round(time.monotonic() - started, 1)
    results["repeat"] = repeat
    if args.json:
        bench.emit_json("scaleout", results, rat)
        return 0
    for h in counts:
        r = results[f"{h}_hosts"]
        print(f"{h} host(s): {r['tool_calls_per_s']:>8.1f} tool calls/s  (runs {r['runs']})")
    for k, v in rat.items():
        print(f"{k:<32}{v:>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
