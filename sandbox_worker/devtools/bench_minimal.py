"""The baseline of ``scripts/bench sessions``: a minimal in-process agent loop.

``python -m sandbox_worker.devtools.bench_minimal --url URL --workspace WS --levels 1:20,100:5``
runs, for each level ``N:M``, N concurrent sessions of M turns each, with no
broker and no persistence. A turn is what the supervisor path does on the
same scripted provider:

1. POST ``{url}/responses`` (OpenAI Responses wire format, streamed SSE) with
   the session's whole context, read the stream to ``response.completed``,
   through the worker's own httpx client set-up (``model/pool.py``);
2. run the function call it returns with the worker's own code: the tool
   sandbox profile is built by ``ToolService.start`` (same tier detection,
   seccomp filter, cgroup and uid as a worker) and the call goes through
   ``run_shell`` (the same argv chain: setpriv, prlimit, bwrap) as a uid
   leased from the service's ``UidPool``, as the worker does;
3. POST again with the call and its output, read the final answer.

Concurrent model and tool calls are bounded by ``--slots`` (the bench passes
the farm's total worker capacity, so both paths get the same parallelism).

It prints one JSON line: ``{"event": "ready"}`` once the sandbox is up, then
``{"event": "result", "levels": {...}}`` with, per level, the turns, the wall
time, turns/s and the CPU per turn of this process (its own threads, and the
sandboxed children it reaped, apart).

This lives outside ``supervisor/`` because it reuses worker internals
(``sandbox_worker.tools``), which the supervisor may not import.

Invariants: every turn is checked (a tool call, then a text answer); a
failed turn fails the run, never counts; every wait on the provider has a
deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

import httpx
import psutil

from sandbox_worker.api import ToolLimits
from sandbox_worker.model.http import open_stream
from sandbox_worker.model.pool import ClientShards
from sandbox_worker.sandbox.limits import DEFAULT_LIMITS
from sandbox_worker.tools.schemas import SCHEMAS
from sandbox_worker.tools.service import ToolService, ToolServiceConfig
from sandbox_worker.tools.shell import render, run_shell

MODEL_TIMEOUT_S = 60.0
TOOL_REMAINING_S = 600.0
INSTRUCTIONS = "You are a helpful coding agent."


class TurnFailed(RuntimeError):
    """A turn did not go tool call -> output -> text answer."""


def parse_levels(text: str) -> list[tuple[int, int]]:
    levels: list[tuple[int, int]] = []
    for part in text.split(","):
        n, _, m = part.partition(":")
        if not (n.isdigit() and m.isdigit()) or int(n) < 1 or int(m) < 1:
            raise argparse.ArgumentTypeError(f"level {part!r} is not N:M (positive integers)")
        levels.append((int(n), int(m)))
    return levels


class Loop:
    def __init__(self, url: str, workspace: str, slots: int, tools: ToolService,
                 http: ClientShards) -> None:
        self.url = url.rstrip("/") + "/responses"
        self.workspace = workspace
        self.slots = asyncio.Semaphore(slots)
        self.tools = tools
        self.http = http
        self.timeout = httpx.Timeout(MODEL_TIMEOUT_S)
        self.limits = ToolLimits(**DEFAULT_LIMITS)  # as the supervisor path: the defaults
        # every tool is offered, as the supervisor does (same request size)
        self.schemas = [{"type": "function", "name": s["name"], "description": s["description"],
                         "parameters": s["parameters"]} for s in SCHEMAS]

    async def model(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        body = {"model": "scripted", "instructions": INSTRUCTIONS, "input": items,
                "tools": self.schemas, "stream": True}
        request = httpx.Request("POST", self.url, json=body,
                                extensions={"timeout": self.timeout.as_dict()})
        async with self.slots, asyncio.timeout(MODEL_TIMEOUT_S), \
                self.http.lease(request.url) as transport, \
                open_stream(transport, request) as resp:
            if resp.status_code != 200:
                raise TurnFailed(f"provider answered {resp.status_code}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if event.get("type") == "response.completed":
                    output: list[dict[str, Any]] = event["response"]["output"]
                    return output
        raise TurnFailed("the stream ended without response.completed")

    async def shell(self, call: dict[str, Any]) -> str:
        profile, pool = self.tools.profile, self.tools.pool
        if profile is None or pool is None:
            raise TurnFailed("the tool sandbox is not started")
        args = json.loads(call["arguments"])
        async with self.slots:
            # as the worker does: one leased uid per call, given back once its tree is gone
            lease = await pool.acquire(timeout_s=TOOL_REMAINING_S)
            try:
                run = await run_shell(profile, args, self.workspace, self.limits,
                                      network=False, uid=lease.uid, call_id=call["call_id"],
                                      remaining_s=TOOL_REMAINING_S, on_chunk=None, grace_s=2.0)
            finally:
                await pool.give_back(lease)
        if run.outcome.exit_code != 0:
            raise TurnFailed(f"the tool call exited {run.outcome.exit_code}: "
                             f"{render(run, self.limits)[0][:300]!r}")
        return render(run, self.limits)[0]

    async def session(self, turns: int) -> None:
        items: list[dict[str, Any]] = []
        for t in range(turns):
            items.append({"type": "message", "role": "user",
                          "content": [{"type": "input_text", "text": f"turn {t}"}]})
            out = await self.model(items)
            calls = [i for i in out if i.get("type") == "function_call"]
            if len(calls) != 1 or calls[0]["name"] != "shell":
                raise TurnFailed(f"turn {t}: expected one shell call, got {out}")
            items.extend(out)
            items.append({"type": "function_call_output", "call_id": calls[0]["call_id"],
                          "output": await self.shell(calls[0])})
            out = await self.model(items)
            if not any(i.get("type") == "message" for i in out):
                raise TurnFailed(f"turn {t}: expected a text answer, got {out}")
            items.extend(out)


async def run_levels(ns: argparse.Namespace) -> dict[str, Any]:
    tools = ToolService(ToolServiceConfig())
    await tools.start()
    try:
        print(json.dumps({"event": "ready", "tier": tools.profile.tier if tools.profile else None}),
              flush=True)
        # the worker's own client set-up (model/pool.py), as for the sandbox code
        http = ClientShards(max_connections=ns.slots, max_keepalive=ns.slots,
                            keepalive_expiry_s=30.0, http2=False, trust_env=False)
        try:
            loop = Loop(ns.url, ns.workspace, ns.slots, tools, http)
            await loop.session(1)  # warm-up: connections, sandbox caches
            me = psutil.Process()
            results: dict[str, Any] = {}
            for n, m in ns.levels:
                cpu0 = me.cpu_times()
                started = time.monotonic()
                async with asyncio.TaskGroup() as tg:
                    for _ in range(n):
                        tg.create_task(loop.session(m))
                wall = time.monotonic() - started
                cpu1 = me.cpu_times()
                turns = n * m
                own = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
                kids = ((cpu1.children_user - cpu0.children_user)
                        + (cpu1.children_system - cpu0.children_system))
                results[str(n)] = {"sessions": n, "turns_each": m, "turns": turns,
                                   "wall_s": round(wall, 3),
                                   "turns_per_s": round(turns / wall, 2),
                                   "cpu_ms_per_turn": round(own / turns * 1000, 3),
                                   "children_cpu_ms_per_turn": round(kids / turns * 1000, 3)}
            return results
        finally:
            await http.aclose()
    finally:
        await tools.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sandbox_worker.devtools.bench_minimal",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the scripted provider's base URL")
    parser.add_argument("--workspace", required=True, help="an absolute, reachable directory")
    parser.add_argument("--levels", type=parse_levels, required=True, help="N:M[,N:M...]")
    parser.add_argument("--slots", type=int, default=128,
                        help="concurrent model + tool calls (the farm's worker capacity)")
    ns = parser.parse_args(argv)
    if not os.path.isabs(ns.workspace):
        parser.error("--workspace must be absolute")
    results = asyncio.run(run_levels(ns))
    print(json.dumps({"event": "result", "levels": results}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
