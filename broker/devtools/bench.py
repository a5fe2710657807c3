"""Broker benchmark: ``python -m broker.devtools.bench [--quick] [--json]``.

Round trips of ~200-byte msgpack bodies over ipc and over tcp loopback, with 1
and with 64 requests in flight, through three middles, measured in the same
run with the SAME minimal blocking client and echo-worker loops (so only the
middle differs):

- ``direct``: the client's DEALER talks to the worker's ROUTER, no broker;
- ``proxy``:  libzmq's C ``zmq.proxy`` (ROUTER/DEALER device) in a subprocess;
- ``broker``: our broker process (``python -m broker``).

Both loops always speak Corral frames (REQUEST in, REPLY out; the worker
decodes the metadata to echo the id), so the per-message work at the ends is
identical in every mode. Results: p50/p99 latency at 1 in flight, msgs/s at 1
and 64 in flight; ratios of the broker to the proxy and to direct. Extra
results: the full public-API path (BrokerClient → broker → BrokerWorker with
the echo handler), to show what the asyncio layers cost.

The machine is shared and noisy (PERF.md: p50 moves 10-30 % between runs, and
throughput at 64 in flight up to 2x), so the middles are not measured one
after the other: all three run side by side and the client measures them in
turn, in ``--repeat`` short slices per transport, rotating which goes first.
Each slice starts with its own warm-up (a new client connection); the median
over the slices is reported, and ratios are within the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Final

import msgpack
import zmq

from broker import protocol

PYTHON: Final = sys.executable
REQUEST_KIND: Final = bytes((protocol.Kind.REQUEST,))
REPLY_KIND: Final = bytes((protocol.Kind.REPLY,))
HEARTBEAT_FRAMES: Final = protocol.encode(protocol.Heartbeat("bench-worker"))
BODY: Final = msgpack.packb({
    "call_id": "call_0123456789abcdef", "tool": "read_file", "session_id": "s-0123456789",
    "arguments": {"path": "/workspace/src/module/file_name.py", "offset": 0, "limit": 2000},
    "workspace": "/srv/corral/workspaces/s-0123456789", "pad": "x" * 24,
}, use_bin_type=True)


# ---------------------------------------------------------------------- worker/proxy roles

def run_worker(mode: str, endpoint: str, *,
               configure: Callable[[zmq.Socket[bytes]], None] | None = None) -> None:
    """The echo worker loop (a subprocess): ROUTER bound for direct, DEALER otherwise.

    ``configure`` sets up the socket before it binds or connects (the CURVE
    bench applies the worker's keys), as for ``client_run``."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER if mode == "direct" else zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if configure is not None:
        configure(sock)
    if mode == "direct":
        sock.bind(endpoint)
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    else:
        sock.connect(endpoint)
    speaks_broker = mode == "broker"
    if speaks_broker:
        sock.send_multipart(protocol.encode(protocol.Ready(("echo",), 4096, {"role": "bench"})))
    print(json.dumps({"event": "ready", "endpoint": endpoint}), flush=True)
    header, unpackb, packb = protocol.HEADER, msgpack.unpackb, msgpack.packb
    next_beat = time.monotonic() + 0.25
    while True:
        if sock.poll(100):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                i = frames.index(header)
                if frames[i + 1] != REQUEST_KIND:
                    continue
                rid = unpackb(frames[i + 2])["id"]
                sock.send_multipart([*frames[:i], header, REPLY_KIND, packb({"id": rid}),
                                     frames[i + 3]])
        if speaks_broker and time.monotonic() >= next_beat:
            sock.send_multipart(HEARTBEAT_FRAMES)
            next_beat = time.monotonic() + 0.25


def run_proxy(frontend: str, backend: str) -> None:
    ctx = zmq.Context()
    front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    front.bind(frontend)
    back.bind(backend)
    print(json.dumps({"event": "ready",
                      "frontend": front.getsockopt_string(zmq.LAST_ENDPOINT),
                      "backend": back.getsockopt_string(zmq.LAST_ENDPOINT)}), flush=True)
    zmq.proxy(front, back)


# ---------------------------------------------------------------------- client loop

def client_run(endpoint: str, in_flight: int, total: int, warmup: int, *,
               configure: Callable[[zmq.Socket[bytes]], None] | None = None,
               ) -> dict[str, float]:
    """The blocking client loop: keep ``in_flight`` requests outstanding.

    ``configure`` sets up the socket before it connects (the CURVE bench uses it
    to apply the client's keys), so every variant measures the same loop."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if configure is not None:
        configure(sock)
    sock.connect(endpoint)
    header, packb, unpackb = protocol.HEADER, msgpack.packb, msgpack.unpackb
    sent_at: dict[str, float] = {}
    latencies: list[float] = []
    next_id = 0

    def send() -> None:
        nonlocal next_id
        next_id += 1
        rid = f"{next_id:x}"
        meta = packb({"id": rid, "svc": "echo", "b": 30.0, "a": 1})
        sent_at[rid] = time.perf_counter()
        sock.send_multipart([header, REQUEST_KIND, meta, BODY])

    try:
        for _ in range(min(in_flight, warmup + total)):
            send()
        done = 0
        started = time.perf_counter()
        while done < warmup + total:
            if not sock.poll(10_000):
                raise RuntimeError(f"no reply within 10 s ({done} done) via {endpoint}")
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if frames[1] != REPLY_KIND:
                    continue  # broker heartbeats
                t1 = time.perf_counter()
                t0 = sent_at.pop(unpackb(frames[2])["id"])
                done += 1
                if done == warmup:
                    started = t1
                    latencies.clear()
                elif done > warmup:
                    latencies.append(t1 - t0)
                if next_id < warmup + total:
                    send()
        elapsed = time.perf_counter() - started
    finally:
        sock.close()
    return _summary(latencies, total / elapsed)


def _summary(latencies: list[float], rate: float) -> dict[str, float]:
    latencies.sort()
    return {
        "p50_us": round(latencies[len(latencies) // 2] * 1e6, 1),
        "p99_us": round(latencies[int(len(latencies) * 0.99)] * 1e6, 1),
        "msgs_per_s": round(rate),
    }


# ---------------------------------------------------------------------- process plumbing

@contextmanager
def _spawn(argv: list[str]) -> Iterator[dict[str, Any]]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        if proc.stdout is None:
            raise RuntimeError("no stdout pipe")
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{argv[:3]} exited before it was ready")
        yield dict(json.loads(line))
    finally:
        proc.kill()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def _endpoints(transport: str, tmp: Path, tag: str) -> tuple[str, str]:
    if transport == "ipc":
        return f"ipc://{tmp}/{tag}-f", f"ipc://{tmp}/{tag}-b"
    return "tcp://127.0.0.1:0", "tcp://127.0.0.1:0"


@contextmanager
def middle(mode: str, transport: str, tmp: Path) -> Iterator[str]:
    """Start worker (+ proxy or broker); yield the endpoint the client connects to."""
    me = [PYTHON, "-m", "broker.devtools.bench"]
    front, back = _endpoints(transport, tmp, mode)
    if mode == "direct":
        with _spawn([*me, "--role", "worker", "--mode", mode, "--endpoint", back]) as ready:
            yield str(ready["endpoint"])
        return
    if mode == "proxy":
        mid = [*me, "--role", "proxy", "--frontend", front, "--backend", back]
    else:
        mid = [PYTHON, "-m", "broker", "--frontend", front, "--backend", back]
    with _spawn(mid) as ready, _spawn([*me, "--role", "worker", "--mode", mode,
                                       "--endpoint", str(ready["backend"])]):
        endpoint = str(ready["frontend"])
        client_run(endpoint, 1, 50, 10)  # the worker is connected and registered
        yield endpoint


async def _api_path(endpoint: str, in_flight: int, total: int) -> dict[str, float]:
    from broker.client import BrokerClient

    async with BrokerClient(endpoint) as client:
        for _ in range(50):
            await client.request("echo", BODY, budget_s=10)
        latencies: list[float] = []
        remaining = iter(range(total))

        async def lane() -> None:
            for _ in remaining:
                t0 = time.perf_counter()
                await client.request("echo", BODY, budget_s=30)
                latencies.append(time.perf_counter() - t0)

        started = time.perf_counter()
        async with asyncio.TaskGroup() as tg:
            for _ in range(in_flight):
                tg.create_task(lane())
        return _summary(latencies, total / (time.perf_counter() - started))


def api_path(tmp: Path, n1: int, n64: int) -> dict[str, dict[str, float]]:
    front, back = _endpoints("ipc", tmp, "api")
    with _spawn([PYTHON, "-m", "broker", "--frontend", front, "--backend", back]) as ready, \
            _spawn([PYTHON, "-m", "broker.echo", "--backend", str(ready["backend"]),
                    "--capacity", "64"]):
        return {
            "inflight1": asyncio.run(_api_path(str(ready["frontend"]), 1, n1)),
            "inflight64": asyncio.run(_api_path(str(ready["frontend"]), 64, n64)),
        }


# ---------------------------------------------------------------------- the run

MODES: Final = ("direct", "proxy", "broker")


def run(quick: bool, rounds: int) -> dict[str, Any]:
    """All three middles run side by side (idle ones only wait); the client measures
    them in turn, in ``rounds`` short slices, rotating which goes first, so each
    sees the same load from the rest of the machine. Medians over the slices."""
    n1, n64 = (1500, 15_000) if quick else (10_000, 100_000)
    per1, per64 = max(n1 // rounds, 100), max(n64 // rounds, 1000)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="corral-bench-", dir="/tmp") as tmpdir:
        tmp = Path(tmpdir)
        for transport in ("ipc", "tcp"):
            runs: dict[str, list[dict[str, dict[str, float]]]] = {m: [] for m in MODES}
            with ExitStack() as stack:
                endpoints = {m: stack.enter_context(middle(m, transport, tmp)) for m in MODES}
                for r in range(rounds):
                    for mode in MODES[r % 3:] + MODES[:r % 3]:
                        runs[mode].append({
                            "inflight1": client_run(endpoints[mode], 1, per1, 50),
                            "inflight64": client_run(endpoints[mode], 64, per64, 640),
                        })
            results[transport] = {mode: _median(r) for mode, r in runs.items()}
        results["api_path_ipc"] = api_path(tmp, *((750, 3000) if quick else (2500, 10_000)))
    return results


def _median(runs: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {
        case: {k: statistics.median(r[case][k] for r in runs) for k in runs[0][case]}
        for case in runs[0]
    }


def ratios(results: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for transport in ("ipc", "tcp"):
        r = results[transport]
        b1, p1, d1 = r["broker"]["inflight1"], r["proxy"]["inflight1"], r["direct"]["inflight1"]
        b64, p64 = r["broker"]["inflight64"], r["proxy"]["inflight64"]
        prefix = "" if transport == "ipc" else "tcp_"
        out[f"{prefix}p50_vs_proxy"] = round(b1["p50_us"] / p1["p50_us"], 3)
        out[f"{prefix}p99_vs_proxy"] = round(b1["p99_us"] / p1["p99_us"], 3)
        out[f"{prefix}throughput64_vs_proxy"] = round(b64["msgs_per_s"] / p64["msgs_per_s"], 3)
        out[f"{prefix}p50_vs_direct"] = round(b1["p50_us"] / d1["p50_us"], 3)
    api, b = results["api_path_ipc"], results["ipc"]["broker"]
    out["api_p50_vs_raw_broker"] = round(api["inflight1"]["p50_us"] / b["inflight1"]["p50_us"], 3)
    out["api_throughput64_vs_raw_broker"] = round(
        api["inflight64"]["msgs_per_s"] / b["inflight64"]["msgs_per_s"], 3)
    return out


def emit_json(name: str, results: dict[str, Any], ratios: dict[str, float]) -> None:
    """The ``--json`` output of a broker benchmark: one object on stdout, also
    written to ``bench-results/NAME.json``."""
    doc = {"name": name, "machine": machine(), "results": results, "ratios": ratios}
    Path("bench-results").mkdir(exist_ok=True)
    Path(f"bench-results/{name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc))


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(), "cpus": os.cpu_count(),
        "python": platform.python_version(), "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(), "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


def print_table(results: dict[str, Any], rat: dict[str, float]) -> None:
    print(f"{'path':<22}{'p50 µs':>10}{'p99 µs':>10}{'msg/s @1':>11}{'msg/s @64':>11}"
          f"{'p50 @64':>10}")
    rows = [(f"{t} {m}", results[t][m]) for t in ("ipc", "tcp")
            for m in ("direct", "proxy", "broker")]
    rows.append(("api path (ipc)", results["api_path_ipc"]))
    for name, r in rows:
        one, many = r["inflight1"], r["inflight64"]
        print(f"{name:<22}{one['p50_us']:>10.0f}{one['p99_us']:>10.0f}"
              f"{one['msgs_per_s']:>11.0f}{many['msgs_per_s']:>11.0f}{many['p50_us']:>10.0f}")
    print()
    for k, v in rat.items():
        print(f"{k:<34}{v:>8.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m broker.devtools.bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a reduced run, under 60 s")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object and write bench-results/broker.json")
    parser.add_argument("--repeat", type=int, default=0,
                        help="rounds of interleaved slices (default 5 with --quick, else 10); "
                        "with --curve, runs per configuration")
    parser.add_argument("--curve", action="store_true",
                        help="instead: plain tcp vs CURVE + ZAP through our broker "
                        "(broker/devtools/bench_curve.py; bench-results/broker_curve.json)")
    parser.add_argument("--role", choices=["worker", "proxy"], help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--frontend", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "worker":
        run_worker(args.mode, args.endpoint)
        return 0
    if args.role == "proxy":
        run_proxy(args.frontend, args.backend)
        return 0
    if args.curve:
        from broker.devtools import bench_curve

        return bench_curve.main(args.quick, args.json, args.repeat)
    repeat = args.repeat or (5 if args.quick else 10)
    started = time.monotonic()
    results = run(args.quick, repeat)
    rat = ratios(results)
    results["seconds"] = round(time.monotonic() - started, 1)
    results["repeat"] = repeat
    if args.json:
        emit_json("broker", results, rat)
    else:
        print_table(results, rat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
