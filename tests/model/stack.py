"""Test helpers for model calls: a real scripted provider, broker and workers
as child processes (through the ``procs`` fixture), and a client that
collects a call's partials and outcome.

``Stacks`` (the module-scoped ``stacks`` fixture of conftest.py) shares a
broker and one model worker between the tests of a module, one such stack per
set of worker options: a worker start is ~1.2 CPU-s, most of a test here.
Only for tests that neither kill nor watch a worker; each test still starts
its own scripted provider, so what a test asserts on (the provider's stats and
recorded requests, the call's partials) is its own.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from broker.client import BrokerClient
from broker.errors import RequestFailed
from broker.protocol import pack, unpack
from sandbox_worker.api import SERVICE_MODEL
from tests.helpers import Procs, read_line_with_deadline

PROVIDERS = ("openai-responses", "openai-chat", "anthropic")
READY_S = 30.0


def start_fake(procs: Procs, tmp_path: Path, script: dict[str, Any]) -> str:
    path = tmp_path / f"script-{len(procs.started)}.json"
    path.write_text(json.dumps(script))
    proc = procs.python("sandbox_worker.fakellm", "--script", str(path), name="fakellm",
                        stdout=subprocess.PIPE)
    ready = json.loads(read_line_with_deadline(proc, READY_S))
    return str(ready["url"])


@dataclass
class Stack:
    procs: Procs
    frontend: str
    backend: str
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def add_worker(self, *args: str, env: dict[str, str] | None = None,
                   name: str = "worker") -> subprocess.Popen[bytes]:
        proc = self.procs.python(
            "sandbox_worker", "--broker", self.backend, "--services", SERVICE_MODEL,
            "--heartbeat-interval-s", "0.1", "--liveness", "5", *args,
            name=name, env=env, stdout=subprocess.PIPE)
        line = json.loads(read_line_with_deadline(proc, READY_S))
        if line.get("event") != "ready":
            raise AssertionError(f"worker not ready: {line}")
        self.workers.append(proc)
        return proc


def start_stack(procs: Procs, tmp_path: Path, *worker_args: str, workers: int = 1,
                env: dict[str, str] | None = None) -> Stack:
    sock_dir = tmp_path / "s"
    sock_dir.mkdir(exist_ok=True)
    broker = procs.python("broker", "--frontend", f"ipc://{sock_dir}/f",
                          "--backend", f"ipc://{sock_dir}/b", "--heartbeat-interval-s", "0.1",
                          "--liveness", "5", name="broker", stdout=subprocess.PIPE)
    ready = json.loads(read_line_with_deadline(broker, READY_S))
    stack = Stack(procs, ready["frontend"], ready["backend"])
    for _ in range(workers):
        stack.add_worker(*worker_args, env=env)
    return stack


class Stacks:
    """Broker + one model worker per set of worker options, started at first use
    and stopped (by pid) with the ``Procs`` they were started through."""

    def __init__(self, procs: Procs, tmp: Path) -> None:
        self.procs = procs
        self.tmp = tmp
        self._by_args: dict[tuple[str, ...], Stack] = {}

    def get(self, *worker_args: str) -> Stack:
        stack = self._by_args.get(worker_args)
        if stack is None:
            where = self.tmp / f"stack-{len(self._by_args)}"
            where.mkdir()
            stack = start_stack(self.procs, where, *worker_args)
            self._by_args[worker_args] = stack
        for worker in stack.workers:
            if worker.poll() is not None:
                raise AssertionError(f"a shared model worker died (exit {worker.returncode}): "
                                     f"{self.procs.log(worker)}")
        return stack


def route(provider: str, url: str, **extra: Any) -> dict[str, Any]:
    return {"name": "main", "provider": provider, "model": "test-model", "base_url": url,
            **extra}


def request(provider: str, url: str, *, items: list[dict[str, Any]] | None = None,
            stream: bool = True, tools: list[dict[str, Any]] | None = None,
            op: str = "respond", **route_extra: Any) -> dict[str, Any]:
    return {"op": op, "route": route(provider, url, **route_extra),
            "instructions": "You are a test.",
            "items": items if items is not None else [
                {"type": "message", "role": "user", "content": "hello"}],
            "tools": tools or [], "stream": stream, "session_id": "sess-1"}


@dataclass
class Outcome:
    partials: list[dict[str, Any]]
    result: dict[str, Any] | None
    error: RequestFailed | None

    def text(self) -> str:
        """Relayed text after the last discard marker."""
        out: list[str] = []
        for p in self.partials:
            if p["type"] == "retry" and p.get("discard_partial"):
                out = []
            elif p["type"] == "text_delta":
                out.append(p["text"])
        return "".join(out)


async def run_call(client: BrokerClient, body: dict[str, Any], *,
                   timeout_s: float = 20.0, attempt: int = 1) -> Outcome:
    call = client.start(SERVICE_MODEL, pack(body), budget_s=timeout_s, attempt=attempt)
    partials = [unpack(p) async for p in call]
    try:
        return Outcome(partials, unpack(await call.result()), None)
    except RequestFailed as exc:
        return Outcome(partials, None, exc)


def stats(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/_corral/stats", timeout=5).json()  # type: ignore[no-any-return]


async def astats(url: str) -> dict[str, Any]:
    """``stats`` without blocking the event loop (the client must keep heartbeating)."""
    async with httpx.AsyncClient() as client:
        reply = await client.get(f"{url}/_corral/stats", timeout=5)
    return reply.json()  # type: ignore[no-any-return]


def recorded(url: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/_corral/requests", timeout=5).json()  # type: ignore[no-any-return]
