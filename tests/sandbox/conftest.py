"""Fixtures of the sandbox tests: a real broker and a real tool worker per tier,
a root-owned 0755 workspace, host-side probes, and helpers to make tool calls
through ``BrokerClient``.

A stack (broker + ``python -m sandbox_worker --services tool``) is started once
per module and tier, and killed by pid at the end (``Procs.kill_all``).
Tests that need a stack of their own (a forced tier, flags, a worker to
SIGKILL) start it through ``stack_procs``; the layers alone use ``user`` and
``filters``. The detected tier is printed in the pytest summary.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from broker.client import BrokerClient
from broker.protocol import pack, unpack
from sandbox_worker.sandbox.seccomp import SeccompFilters
from sandbox_worker.sandbox.user import SandboxUser, ensure_user
from tests.helpers import Procs, read_line_with_deadline, searchable_dir

FAKE_KEY = "sk-test-corral-" + "7f3a9c" * 6
HB_S = 0.25


@dataclass
class Stack:
    tier: str
    frontend: str
    ready: dict[str, Any]
    worker: subprocess.Popen[bytes]
    procs: Procs
    backend: str = ""  # the broker's worker endpoint

    @property
    def info(self) -> dict[str, Any]:
        return dict(self.ready["info"]["tool"])

    @property
    def uid(self) -> int:
        """The file tools' uid (the sandbox user's)."""
        return int(self.info["sandbox_uid"])

    @property
    def uids(self) -> range:
        """The per-call uid range shell calls run in."""
        start, count = self.info["sandbox_uid_range"]
        return range(int(start), int(start) + int(count))


@dataclass
class CallResult:
    result: dict[str, Any]
    chunks: list[dict[str, Any]] = field(default_factory=list)

    def streamed(self, stream: str) -> bytes:
        return b"".join(c["data"] for c in self.chunks if c["stream"] == stream)


def start_stack(procs: Procs, tier: str, *extra: str) -> Stack:
    ipc = Path(tempfile.mkdtemp(prefix="csb-", dir="/tmp"))
    broker = procs.python("broker", "--frontend", f"ipc://{ipc}/f", "--backend",
                          f"ipc://{ipc}/b", "--heartbeat-interval-s", str(HB_S),
                          "--liveness", "4", name="broker", stdout=subprocess.PIPE)
    bready = json.loads(read_line_with_deadline(broker, 20.0))
    worker, ready = start_worker(procs, bready["backend"], tier, *extra)
    return Stack(tier, bready["frontend"], ready, worker, procs, bready["backend"])


def start_worker(procs: Procs, backend: str, tier: str, *extra: str,
                 name: str | None = None) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """A tool worker on the broker at ``backend``, and its ready line."""
    args = ["--broker", backend, "--services", "tool", "--capacity", "4",
            "--heartbeat-interval-s", str(HB_S), "--liveness", "4", *extra]
    if tier != "T2":
        args += ["--force-tier", tier, "--tier-min", tier]
    worker = procs.python("sandbox_worker", *args, name=name or f"worker-{tier}",
                          env={"OPENAI_API_KEY": FAKE_KEY, "ANTHROPIC_API_KEY": FAKE_KEY},
                          stdout=subprocess.PIPE)
    try:
        ready = json.loads(read_line_with_deadline(worker, 30.0))
    except AssertionError as exc:
        raise AssertionError(f"worker did not start: {procs.log(worker)}") from exc
    return worker, ready


def start_or_skip(procs: Procs, tier: str, *extra: str) -> Stack:
    """``start_stack``, skipping the test when a forced tier cannot work here."""
    try:
        return start_stack(procs, tier, *extra)
    except AssertionError as exc:
        if tier != "T2" and "does not work here" in str(exc):
            pytest.skip(f"tier {tier} is not available on this machine: {exc}")
        raise


def stop_all(procs: Procs) -> None:
    """Kill every process a stack started, by pid, and close the pipes read from."""
    procs.kill_all()
    for proc in procs.started:
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.fixture(scope="module", params=["T2", "T1"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          ) -> Iterator[Stack]:
    """A broker and a tool worker at the parametrized tier (skipped if it cannot work)."""
    tier = request.param
    procs = Procs(tmp_path_factory.mktemp(f"stack-{tier}"))
    try:
        yield start_or_skip(procs, tier)
    finally:
        stop_all(procs)


@pytest.fixture
def stack_procs(tmp_path: Path) -> Iterator[Procs]:
    """For tests that start stacks of their own (a tier, flags, a worker to
    kill): everything started through it is stopped by pid afterwards."""
    procs = Procs(tmp_path)
    try:
        yield procs
    finally:
        stop_all(procs)


@pytest.fixture(scope="module")
def user() -> SandboxUser:
    """The sandbox user (created if missing), for tests of the layers alone."""
    return asyncio.run(ensure_user())


@pytest.fixture(scope="module")
def filters() -> Iterator[SeccompFilters]:
    """The compiled seccomp filters, closed at the end of the module."""
    f = SeccompFilters.compile()
    try:
        yield f
    finally:
        f.close()


@pytest.fixture
async def client(stack: Stack) -> AsyncIterator[BrokerClient]:
    async with BrokerClient(stack.frontend, heartbeat_interval_s=HB_S) as c:
        yield c


@pytest.fixture
def workspace() -> Iterator[Path]:
    """A user's workspace: owned by root, mode 0755, under a searchable /tmp."""
    with searchable_dir("corral-ws-", "/tmp") as path:
        yield path


@pytest.fixture
def host_dir() -> Iterator[Path]:
    """A fresh host directory outside the workspace (on the same filesystem)."""
    with searchable_dir("corral-host-", "/var/tmp") as path:
        yield path


def request_body(tool: str, args: dict[str, Any], workspace: Path,
                 policy: dict[str, Any] | None = None, call_id: str | None = None,
                 session_id: str = "s-test") -> bytes:
    req: dict[str, Any] = {"call_id": call_id or f"call-{uuid.uuid4().hex[:12]}",
                           "tool": tool, "arguments": args, "session_id": session_id,
                           "workspace": str(workspace)}
    if policy is not None:
        req["policy"] = policy
    return pack(req)


async def call_tool(client: BrokerClient, tool: str, args: dict[str, Any], workspace: Path,
                    policy: dict[str, Any] | None = None, *, timeout_s: float = 60.0,
                    call_id: str | None = None, session_id: str = "s-test") -> CallResult:
    call = client.start("tool", request_body(tool, args, workspace, policy, call_id,
                                             session_id),
                        budget_s=timeout_s)
    chunks = [unpack(body) async for body in call]
    return CallResult(unpack(await call.result()), chunks)


async def shell(client: BrokerClient, command: str | list[str], workspace: Path,
                policy: dict[str, Any] | None = None, **kw: Any) -> CallResult:
    return await call_tool(client, "shell", {"command": command}, workspace, policy, **kw)


def call_processes(uid: int | range, call_id: str | None = None) -> list[psutil.Process]:
    """Live processes of a sandbox uid or uid range (of one call, by its
    CORRAL_CALL_ID marker)."""
    uids = range(uid, uid + 1) if isinstance(uid, int) else uid
    found = []
    for p in psutil.process_iter(["uids", "status"]):
        try:
            if p.info["uids"].real not in uids or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if call_id is not None and p.environ().get("CORRAL_CALL_ID") != call_id:
                continue
            found.append(p)
        except psutil.Error:
            continue
    return found


async def no_call_processes(uid: int | range, call_id: str, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while call_processes(uid, call_id):
        if loop.time() > deadline:
            left = [(p.pid, p.cmdline()) for p in call_processes(uid, call_id)]
            raise AssertionError(f"processes of call {call_id} survived: {left}")
        await asyncio.sleep(0.05)



# Host-state probes (plain functions: reading the host is the point of the test).
def host_exists(path: str | Path) -> bool:
    return os.path.lexists(path)


def host_read(path: str | Path) -> str:
    return Path(path).read_text()


def host_list(path: str | Path) -> list[str]:
    return sorted(os.listdir(path))


def needs_system_python() -> None:
    """Some probes run python3 inside the sandbox, which sees only /usr."""
    if not os.path.exists("/usr/bin/python3"):
        pytest.skip("probe runs python3 inside the sandbox; /usr/bin/python3 is not installed")
