"""Client tools when things die, through real processes: the program holding a
client tool is SIGKILLed (by pid) while its tool runs, and the supervisor is
SIGKILLed while a client tool runs (the farm restarts it)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from supervisor.sdk import (
    EmbeddedFarm,
    Event,
    SessionOptions,
    ToolCallEnd,
    TurnComplete,
    tool,
)
from tests.helpers import PYTHON, Procs, eventually, read_line_with_deadline

module_loop = pytest.mark.asyncio(loop_scope="module")
# The SDK's liveness window (3 s) plus the server's heartbeat period (0.5 s):
# a killed program's call must end unknown within this, with room for a loaded machine.
LOST_BOUND_S = 8.0


async def collect(stream: Any) -> list[Event]:
    return [e async for e in stream]


@module_loop
async def test_a_killed_client_ends_its_call_unknown_and_later_calls_fail_typed(
        farm: EmbeddedFarm, workspace: Path, procs: Procs, tmp_path: Path) -> None:
    marker = tmp_path / "probe-running"
    import subprocess

    prog = procs.spawn([PYTHON, "-m", "tests.sdk.client_prog", farm.endpoint,
                        str(workspace), str(marker)], name="client", stdout=subprocess.PIPE)
    sid = await asyncio.to_thread(read_line_with_deadline, prog, 30.0)

    async def running() -> bool:
        return marker.exists()
    await eventually(running, timeout_s=30, what="the client tool to start")
    assert int(marker.read_text()) == prog.pid
    os.kill(prog.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    async with farm.connect() as corral:
        session = await corral.resume(sid)
        ended: ToolCallEnd | None = None
        async for event in session.events(timeout_s=30):
            if isinstance(event, ToolCallEnd) and ended is None:
                ended = event
                took = time.monotonic() - killed_at
            if isinstance(event, TurnComplete):
                break
        assert ended is not None
        assert ended.name == "probe"
        assert ended.state == "unknown"
        assert ended.error is not None
        assert ended.error.kind == "worker_lost"
        assert "went away" in ended.error.message
        assert took < LOST_BOUND_S, f"the call ended {took:.1f}s after the kill"
        # The documented rule for a call with no program holding its tool: it
        # waits client_wait_s (1 s here), then fails with a typed error.
        t0 = time.monotonic()
        events = await collect(session.run("again", timeout_s=30))
        waited = time.monotonic() - t0
    end = next(e for e in events if isinstance(e, ToolCallEnd))
    assert end.state == "failed"
    assert end.error is not None
    assert end.error.kind == "client_unavailable"
    assert isinstance(events[-1], TurnComplete)
    assert waited >= 1.0


@module_loop
async def test_a_supervisor_restart_while_a_client_tool_runs(farm: EmbeddedFarm,
                                                             workspace: Path) -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()
    calls: list[int] = []

    @tool
    async def probe(x: int) -> str:
        calls.append(x)
        if x == 1:
            started.set()
            try:
                await asyncio.Event().wait()  # the supervisor dies meanwhile
            except asyncio.CancelledError:
                cancelled.set()
                raise
        return f"after the restart {x}"

    async with farm.connect() as corral:
        session = await corral.create_session(SessionOptions(workspace=workspace,
                                                             approval="allow"), tools=[probe])
        first: list[Event] = []

        async def follow() -> None:
            async for event in session.run("go", timeout_s=60):
                first.append(event)

        async with asyncio.TaskGroup() as tg:
            tg.create_task(follow())
            async with asyncio.timeout(30):
                await started.wait()
            old = farm.pids()["supervisor"]
            os.kill(old, signal.SIGKILL)
        assert farm.pids()["supervisor"] != old
        async with asyncio.timeout(10):
            await cancelled.wait()  # the program stopped the orphaned call
        # The next turn's call reaches the program again: it re-registered.
        second = await collect(session.run("again", timeout_s=60))
    end = next(e for e in first if isinstance(e, ToolCallEnd))
    assert end.state == "unknown"
    assert "supervisor restarted" in end.output
    assert isinstance(first[-1], TurnComplete)
    end2 = next(e for e in second if isinstance(e, ToolCallEnd))
    assert (end2.state, end2.output) == ("ok", "after the restart 2")
    assert calls == [1, 2]
