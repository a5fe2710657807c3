"""Benchmark: a 2,000-token scripted answer streamed through worker and broker.

``python -m sandbox_worker.devtools.model_bench [--quick] [--json] [--tokens N] [--rounds N]``

Starts the scripted provider, a broker and one model worker as child
processes. In one run, call by call in a new random order every round (so
all see the same machine noise, and none always follows the same one), it
measures three ways of reading the same stream from the same server:

- direct: in-process, the worker's own HTTP path (``http.build_request`` and
  ``http.open_stream`` on an ``httpx.AsyncHTTPTransport``) streaming
  ``POST /responses`` and parsing its SSE events: the same HTTP code as the
  worker's, with no broker and no worker (the baseline of every ratio);
- client: the same through ``httpx.AsyncClient.stream``, what a user calling
  the provider with httpx would write (0.1-0.2 ms slower to the first token;
  reported as ``first_token_vs_client`` and ``stream_vs_client``);
- brokered: the same request as a ``model`` call through broker and worker,
  read by a ``BrokerClient`` as PARTIALs.

Each way is timed for first-token latency (request sent → first text delta
in hand) and for the whole answer (→ last event / REPLY), in two scenarios:

- ``unpaced``: the provider writes the 2,000 events as fast as it can, so the
  provider, the worker and the reader all want the CPU at once (worst case on
  a 2-core machine; the headline ratios);
- ``paced``: the provider pauses ``--pace-s`` between events, as a real
  model does (hundreds of tokens per second); this isolates the hop cost.

Every measured call starts after ``--gap-s`` of idle time (default 20 ms), so
each call and each round trip below starts from the same idle state, as an
agent's model call does between tool calls.

Beside them, in the same rounds, the bench times two empty round trips, the
floor under the brokered first token (four ZeroMQ hops, client to worker and
back):

- ``echo_round_trip``: a small request through our broker to an ``echo``
  worker (``broker.echo``) and back, read by the same ``BrokerClient``;
- ``proxy_round_trip``: the same through libzmq's C ``zmq.proxy`` to a
  blocking echo loop, read by a blocking socket (``broker.devtools.bench``'s proxy
  roles): what four hops cost with no Python in the middle.

``floor_first_token_vs_direct`` is (direct first token + the C proxy's round
trip) / direct first token: the best ratio any ZeroMQ broker could reach on
this machine, in this run. ``echo_first_token_vs_direct`` does the same with
our own stack's empty round trip.

Results are medians (and p90) in ms; ratios are brokered / direct (targets:
first token <= 1.3, stream <= 1.2). ``--json`` prints one JSON object; the
object is always written to bench-results/model.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import msgpack
import zmq

from broker import protocol
from broker.client import BrokerClient
from broker.devtools import bench as broker_bench
from broker.devtools import children
from broker.protocol import pack, unpack
from sandbox_worker.api import SERVICE_MODEL, ModelCallRequest
from sandbox_worker.model.http import body_for, build_request, headers_for, open_stream
from sandbox_worker.model.sse import SSEParser

READY_S = 30.0
ECHO_BODY = b"x" * 600  # about the size of a model REQUEST's metadata and first PARTIAL


def _machine() -> dict[str, Any]:
    return {"python": platform.python_version(), "cpus": os.cpu_count(),
            "platform": platform.platform(), "load_1m": round(os.getloadavg()[0], 2)}


def _autogroup_nice(pid: int, nice: int) -> bool:
    """Give ``pid``'s autogroup the nice value ``nice``; True if it took.

    With ``kernel.sched_autogroup_enabled`` (the default on desktop and many
    server kernels) every session is a scheduling group, and a process's own
    nice only weighs it against its own session. The children are started in
    new sessions, so ``nice -n`` alone leaves the provider competing with the
    worker, broker and reader as an equal; the group's nice is what counts.
    """
    path = Path(f"/proc/{pid}/autogroup")
    try:
        path.write_text(str(nice))
    except OSError:
        return False  # no autogroup support: the process nice is the one that counts
    return True


@contextmanager
def _children(tmp: Path, tokens: int, pace_s: float, nice: int
              ) -> Iterator[tuple[str, str, str, bool]]:
    """Yield (provider URL, broker frontend, C proxy frontend, provider's autogroup
    niced); stop and reap every child after."""
    script = tmp / "script.json"
    # Entry 0: unpaced; entry 1: paced (selected by one prior output, k = 1).
    script.write_text(json.dumps({"responses": [
        {"text_tokens": tokens}, {"text_tokens": tokens, "chunk_delay_s": pace_s}]}))
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(*args: str, prefix: tuple[str, ...] = ()) -> dict[str, Any]:
        proc = children.spawn([*prefix, sys.executable, "-m", *args])
        procs.append(proc)
        return children.ready_line(proc, READY_S, args[0])

    try:
        # The scripted provider stands in for a remote service, whose CPU is not
        # ours: at a lower priority it competes less with the measured path.
        prefix = ("nice", "-n", str(nice)) if nice else ()
        url = spawn("sandbox_worker.fakellm", "--script", str(script), prefix=prefix)["url"]
        grouped = bool(nice) and _autogroup_nice(procs[-1].pid, nice)
        broker = spawn("broker", "--frontend", f"ipc://{tmp}/f", "--backend", f"ipc://{tmp}/b")
        spawn("sandbox_worker", "--broker", broker["backend"], "--services", SERVICE_MODEL,
              "--log-level", "WARNING")
        spawn("broker.echo", "--backend", broker["backend"])
        proxy = spawn("broker.devtools.bench", "--role", "proxy", "--frontend", f"ipc://{tmp}/pf",
                      "--backend", f"ipc://{tmp}/pb")
        spawn("broker.devtools.bench", "--role", "worker", "--mode", "proxy", "--endpoint",
              str(proxy["backend"]))
        yield str(url), str(broker["frontend"]), str(proxy["frontend"]), grouped
    finally:
        children.stop(procs)


def _request(url: str, *, paced: bool) -> ModelCallRequest:
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": "go"}]
    if paced:
        items += [{"type": "message", "role": "assistant", "content": "ok"},
                  {"type": "message", "role": "user", "content": "again"}]
    return ModelCallRequest(
        op="respond", route={"name": "bench", "provider": "openai-responses", "model": "bench",
                             "base_url": url},
        instructions="bench", items=items, tools=[], stream=True, session_id="bench")


Opener = Callable[[ModelCallRequest], AbstractAsyncContextManager[httpx.Response]]


def _via_transport(transport: httpx.AsyncHTTPTransport) -> Opener:
    """The worker's own HTTP path, in process."""
    timeout = httpx.Timeout(30.0)

    def open_(req: ModelCallRequest) -> AbstractAsyncContextManager[httpx.Response]:
        request = build_request(req, api_key=None, attempt_no=1, stream=True,
                                http_timeout=timeout)
        return open_stream(transport, request)
    return open_


def _via_client(client: httpx.AsyncClient) -> Opener:
    """``httpx.AsyncClient.stream``, as a user would call the provider."""
    def open_(req: ModelCallRequest) -> AbstractAsyncContextManager[httpx.Response]:
        content = json.dumps(body_for(req, True), separators=(",", ":")).encode()
        return client.stream("POST", f"{req['route']['base_url']}/responses",
                             content=content, headers=headers_for(req, None, 1, True))
    return open_


async def _direct(open_: Opener, req: ModelCallRequest) -> tuple[float, float, int]:
    parser = SSEParser()
    first = 0.0
    chars = 0
    # The clock starts before the body is built, as the brokered path's does
    # (the worker builds the same body inside its timed path).
    started = time.perf_counter()
    async with open_(req) as resp:
        async for chunk in resp.aiter_bytes():
            for event in parser.feed(chunk):
                data = json.loads(event.data)
                if data.get("type") == "response.output_text.delta":
                    if not first:
                        first = time.perf_counter() - started
                    chars += len(data["delta"])
    return first, time.perf_counter() - started, chars


async def _brokered(client: BrokerClient, req: ModelCallRequest) -> tuple[float, float, int, int]:
    first = 0.0
    chars = 0
    partials = 0
    started = time.perf_counter()
    call = client.start(SERVICE_MODEL, pack(req), budget_s=120)
    async for raw in call:
        partials += 1
        delta = unpack(raw)
        if delta["type"] == "text_delta":
            if not first:
                first = time.perf_counter() - started
            chars += len(delta["text"])
    unpack(await call.result())
    return first, time.perf_counter() - started, chars, partials


async def _echo(client: BrokerClient) -> float:
    started = time.perf_counter()
    await client.request("echo", ECHO_BODY, budget_s=10)
    return time.perf_counter() - started


class _ProxyEcho:
    """A blocking DEALER through libzmq's C proxy to ``broker.devtools.bench``'s echo loop."""

    def __init__(self, endpoint: str) -> None:
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.sent = 0

    def round_trip(self) -> float:
        self.sent += 1
        meta = msgpack.packb({"id": f"{self.sent:x}", "svc": "echo", "b": 10.0, "a": 1})
        started = time.perf_counter()
        self.sock.send_multipart([protocol.HEADER, broker_bench.REQUEST_KIND, meta,
                                  ECHO_BODY])
        if not self.sock.poll(10_000):
            raise RuntimeError("no echo through the C proxy within 10 s")
        self.sock.recv_multipart()
        return time.perf_counter() - started

    def close(self) -> None:
        self.sock.close()


def _ms(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"p50_ms": round(statistics.median(ordered) * 1000, 3),
            "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1000, 3)}


async def _scenario(direct: Opener, client: Opener, broker: BrokerClient, proxy: _ProxyEcho,
                    req: ModelCallRequest, rounds: int, gap_s: float) -> dict[str, Any]:
    d_first: list[float] = []
    d_total: list[float] = []
    c_first: list[float] = []
    c_total: list[float] = []
    b_first: list[float] = []
    b_total: list[float] = []
    echo: list[float] = []
    via_proxy: list[float] = []
    partials: list[int] = []
    chars: dict[str, int] = {}

    async def direct_call() -> None:
        f, t, chars["direct"] = await _direct(direct, req)
        d_first.append(f)
        d_total.append(t)

    async def client_call() -> None:
        f, t, chars["client"] = await _direct(client, req)
        c_first.append(f)
        c_total.append(t)

    async def brokered_call() -> None:
        f, t, chars["brokered"], n = await _brokered(broker, req)
        b_first.append(f)
        b_total.append(t)
        partials.append(n)

    async def echo_call() -> None:
        echo.append(await _echo(broker))

    async def proxy_call() -> None:
        via_proxy.append(proxy.round_trip())

    ways = [direct_call, client_call, brokered_call, echo_call, proxy_call]
    order = random.Random(rounds)  # seeded: a run is repeatable
    for _ in range(rounds):
        # A new order every round: what runs just before a call shifts its time
        # (by 0.2-0.4 ms of first token and 4-10 ms of stream, measured with a
        # fixed order), so no way always follows the same one.
        order.shuffle(ways)
        for way in ways:
            await asyncio.sleep(gap_s)
            await way()
        if len(set(chars.values())) != 1:
            raise RuntimeError(f"the readers got different text: {chars} chars")
    first = statistics.median(d_first)
    return {"direct_first_token": _ms(d_first), "brokered_first_token": _ms(b_first),
            "client_first_token": _ms(c_first),
            "direct_stream": _ms(d_total), "brokered_stream": _ms(b_total),
            "client_stream": _ms(c_total),
            "echo_round_trip": _ms(echo), "proxy_round_trip": _ms(via_proxy),
            "partials_per_call_p50": statistics.median(partials), "rounds": rounds,
            "first_token_vs_direct": round(statistics.median(b_first) / first, 3),
            "first_token_vs_client": round(statistics.median(b_first)
                                           / statistics.median(c_first), 3),
            "stream_vs_client": round(statistics.median(b_total)
                                      / statistics.median(c_total), 3),
            "floor_first_token_vs_direct": round(
                (first + statistics.median(via_proxy)) / first, 3),
            "echo_first_token_vs_direct": round((first + statistics.median(echo)) / first, 3),
            "stream_vs_direct": round(statistics.median(b_total)
                                      / statistics.median(d_total), 3)}


async def _run(url: str, frontend: str, proxy_frontend: str, rounds: int, paced_rounds: int,
               gap_s: float) -> dict[str, Any]:
    proxy = _ProxyEcho(proxy_frontend)
    try:
        async with httpx.AsyncHTTPTransport() as transport, httpx.AsyncClient() as http, \
                BrokerClient(frontend) as broker:
            direct, client = _via_transport(transport), _via_client(http)
            unpaced = _request(url, paced=False)
            for _ in range(3):  # warm-up: connections, imports, the provider's cache
                await _direct(direct, unpaced)
                await _direct(client, unpaced)
                await _brokered(broker, unpaced)
                await _echo(broker)
                proxy.round_trip()
            return {"unpaced": await _scenario(direct, client, broker, proxy, unpaced, rounds,
                                               gap_s),
                    "paced": await _scenario(direct, client, broker, proxy,
                                             _request(url, paced=True), paced_rounds, gap_s)}
    finally:
        proxy.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sandbox_worker.devtools.model_bench",
                                     description="Model streaming through worker and broker, "
                                     "against a direct httpx client (see module docstring).")
    parser.add_argument("--quick", action="store_true", help="fewer rounds (< 60 s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=0, help="unpaced rounds")
    parser.add_argument("--paced-rounds", type=int, default=0)
    parser.add_argument("--pace-s", type=float, default=0.0005,
                        help="pause between events in the paced scenario")
    parser.add_argument("--provider-nice", type=int, default=10,
                        help="nice value of the scripted provider (0: same priority)")
    parser.add_argument("--gap-s", type=float, default=0.02,
                        help="idle time before every measured call (see module docstring)")
    ns = parser.parse_args(argv)
    rounds = ns.rounds or (15 if ns.quick else 60)
    paced_rounds = ns.paced_rounds or (3 if ns.quick else 10)
    with tempfile.TemporaryDirectory(prefix="corral-bench-") as tmp, \
            _children(Path(tmp), ns.tokens, ns.pace_s, ns.provider_nice) as (
                url, frontend, proxy_frontend, grouped):
        res = asyncio.run(_run(url, frontend, proxy_frontend, rounds, paced_rounds, ns.gap_s))
    ratios = {"first_token_vs_direct": res["unpaced"]["first_token_vs_direct"],
              "stream_vs_direct": res["unpaced"]["stream_vs_direct"],
              "paced_first_token_vs_direct": res["paced"]["first_token_vs_direct"],
              "paced_stream_vs_direct": res["paced"]["stream_vs_direct"],
              "floor_first_token_vs_direct": res["unpaced"]["floor_first_token_vs_direct"],
              "echo_first_token_vs_direct": res["unpaced"]["echo_first_token_vs_direct"],
              "first_token_vs_client": res["unpaced"]["first_token_vs_client"],
              "stream_vs_client": res["unpaced"]["stream_vs_client"]}
    out = {"name": "model", "machine": _machine(),
           "results": {"tokens": ns.tokens, "pace_s": ns.pace_s, "gap_s": ns.gap_s,
                       "provider_nice": ns.provider_nice,
                       "provider_autogroup_niced": grouped, **res},
           "ratios": ratios}
    Path("bench-results").mkdir(exist_ok=True)
    Path("bench-results/model.json").write_text(json.dumps(out, indent=2) + "\n")
    if ns.json:
        print(json.dumps(out))
        return 0
    print(f"model bench: {ns.tokens}-token scripted answer (medians / p90, ms)")
    print(f"{'scenario':<10}{'measure':<24}{'p50 ms':>10}{'p90 ms':>10}")
    for scen in ("unpaced", "paced"):
        r = res[scen]
        for key in ("direct_first_token", "client_first_token", "brokered_first_token",
                    "direct_stream", "client_stream", "brokered_stream", "echo_round_trip",
                    "proxy_round_trip"):
            print(f"{scen:<10}{key:<24}{r[key]['p50_ms']:>10.2f}{r[key]['p90_ms']:>10.2f}")
        print(f"{scen:<10}{'partials per call':<24}{r['partials_per_call_p50']:>10}"
              f"   ({r['rounds']} rounds)")
    for key, value in ratios.items():
        print(f"{'ratio':<10}{key:<34}{value:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
