"""What CURVE costs: ``python -m broker.devtools.bench --curve [--quick] [--json]``.

Our broker on tcp loopback, measured twice in the same run with the SAME
minimal blocking client and echo-worker loops as ``broker.devtools.bench``: once plain,
once with CURVE + ZAP on both endpoints (client and worker present allowed
keys). Interleaved ``--repeat`` times; medians reported. Results: p50/p99 at 1
in flight, msgs/s at 64 in flight, and the cost of a new connection (connect,
handshake including the ZAP round trip, first request answered).

Ratios: ``curve_p50_vs_plain``, ``curve_p99_vs_plain``,
``curve_throughput64_vs_plain``, ``curve_connect_vs_plain``. With ``--json``
one JSON object is printed and written to ``bench-results/broker_curve.json``.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

from broker.devtools import bench
from broker.security import CurveClient, read_key_file, write_allowed, write_key_pair

PYTHON: Final = sys.executable


def _keys(tmp: Path) -> Path:
    for name in ("broker", "client", "worker"):
        write_key_pair(tmp, name)
    allow = tmp / "allowed"
    write_allowed(allow, "client", read_key_file(tmp / "client.key").public, role="supervisor")
    write_allowed(allow, "worker", read_key_file(tmp / "worker.key").public, role="worker")
    return tmp


def _curve(key_dir: Path | None, name: str) -> CurveClient | None:
    if key_dir is None:
        return None
    return CurveClient.from_files(key_dir / "broker.key", key_dir / f"{name}.key_secret")


def run_worker(endpoint: str, key_dir: Path | None) -> None:
    """``broker.devtools.bench``'s echo worker loop, over CURVE when ``key_dir`` is given."""
    curve = _curve(key_dir, "worker")
    bench.run_worker("broker", endpoint, configure=curve.apply if curve is not None else None)


def client_run(endpoint: str, curve: CurveClient | None, in_flight: int, total: int,
               warmup: int) -> dict[str, float]:
    """``broker.devtools.bench.client_run`` (the same loop) with the client's CURVE keys."""
    return bench.client_run(endpoint, in_flight, total, warmup,
                            configure=curve.apply if curve is not None else None)


def connect_cost(endpoint: str, curve: CurveClient | None, n: int) -> dict[str, float]:
    """New connection → first reply, ``n`` times: what a reconnecting peer pays."""
    times: list[float] = []
    for _ in range(n):
        t0 = time.perf_counter()
        result = client_run(endpoint, curve, 1, 1, 0)
        del result
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"p50_us": round(times[len(times) // 2] * 1e6, 1)}


@contextmanager
def middle(curve: bool, keys: Path) -> Iterator[str]:
    """Our broker on tcp loopback (+ the echo worker), plain or CURVE."""
    argv = [PYTHON, "-m", "broker", "--frontend", "tcp://127.0.0.1:0",
            "--backend", "tcp://127.0.0.1:0"]
    if curve:
        argv += ["--curve-secret", str(keys / "broker.key_secret"),
                 "--allow-dir", str(keys / "allowed")]
    worker = [PYTHON, "-m", "broker.devtools.bench_curve", "--role", "worker"]
    with bench._spawn(argv) as ready:
        worker += ["--endpoint", str(ready["backend"])]
        if curve:
            worker += ["--keys", str(keys)]
        with bench._spawn(worker):
            endpoint = str(ready["frontend"])
            client_run(endpoint, _curve(keys if curve else None, "client"), 1, 50, 10)
            yield endpoint


def run(quick: bool, repeat: int) -> dict[str, Any]:
    n1, n64, nconn = (1500, 15_000, 20) if quick else (5000, 50_000, 50)
    runs: dict[str, list[dict[str, dict[str, float]]]] = {}
    with tempfile.TemporaryDirectory(prefix="corral-bench-curve-", dir="/tmp") as tmpdir:
        keys = _keys(Path(tmpdir))
        for _ in range(repeat):
            for mode in ("plain", "curve"):
                client = _curve(keys, "client") if mode == "curve" else None
                with middle(mode == "curve", keys) as endpoint:
                    runs.setdefault(mode, []).append({
                        "inflight1": client_run(endpoint, client, 1, n1, 200),
                        "inflight64": client_run(endpoint, client, 64, n64, 2000),
                        "connect": connect_cost(endpoint, client, nconn),
                    })
    return {mode: bench._median(r) for mode, r in runs.items()}


def ratios(results: dict[str, Any]) -> dict[str, float]:
    p, c = results["plain"], results["curve"]
    return {
        "curve_p50_vs_plain": round(c["inflight1"]["p50_us"] / p["inflight1"]["p50_us"], 3),
        "curve_p99_vs_plain": round(c["inflight1"]["p99_us"] / p["inflight1"]["p99_us"], 3),
        "curve_throughput64_vs_plain": round(
            c["inflight64"]["msgs_per_s"] / p["inflight64"]["msgs_per_s"], 3),
        "curve_connect_vs_plain": round(c["connect"]["p50_us"] / p["connect"]["p50_us"], 3),
    }


def main(quick: bool, as_json: bool, repeat: int) -> int:
    repeat = repeat or (1 if quick else 3)
    started = time.monotonic()
    results: dict[str, Any] = run(quick, repeat)
    rat = ratios(results)
    results["seconds"] = round(time.monotonic() - started, 1)
    results["repeat"] = repeat
    if as_json:
        bench.emit_json("broker_curve", results, rat)
        return 0
    print(f"{'tcp loopback':<14}{'p50 µs':>10}{'p99 µs':>10}{'msg/s @64':>11}{'connect µs':>12}")
    for mode in ("plain", "curve"):
        r = results[mode]
        print(f"{mode:<14}{r['inflight1']['p50_us']:>10.0f}{r['inflight1']['p99_us']:>10.0f}"
              f"{r['inflight64']['msgs_per_s']:>11.0f}{r['connect']['p50_us']:>12.0f}")
    print()
    for k, v in rat.items():
        print(f"{k:<32}{v:>8.3f}")
    return 0


if __name__ == "__main__":
    # Only the worker role runs this module directly (from ``middle``).
    import argparse

    parser = argparse.ArgumentParser(prog="python -m broker.devtools.bench_curve")
    parser.add_argument("--role", choices=["worker"], required=True)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--keys", type=Path, default=None)
    ns = parser.parse_args()
    run_worker(ns.endpoint, ns.keys)
