"""A whole farm end to end: the CLI's client against the real supervisor,
broker, sandbox workers and scripted provider; then the supervisor and the
broker are SIGKILLed mid-turn and the turn still completes."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from supervisor.client import SupervisorClient
from tests.helpers import eventually

pytestmark = pytest.mark.timeout(180)

TOOL_SCRIPT = {"responses": [
    {"tool_calls": [{"name": "shell",
                     "arguments": {"command": "echo hi > out.txt; echo done"}}]},
    {"text": "wrote out.txt", "usage": {"input": 10, "output": 3}},
]}


async def _turn(sv: SupervisorClient, sid: str, text: str,
                seen: list[dict[str, Any]]) -> dict[str, Any]:
    sub = await sv.submit(sid, {"type": "user_input", "text": text})
    async with asyncio.timeout(60):
        async for e in sv.events(sid):
            seen.append(e)
            if e.get("submission_id") == sub and e["type"] in ("turn_complete",
                                                                 "turn_aborted"):
                return e
    raise AssertionError("event stream ended")


async def test_a_turn_with_a_sandboxed_tool_call(start_farm: Callable[..., Any],
                                                 workspace_root: Path) -> None:
    farm = await start_farm(TOOL_SCRIPT)
    ws = workspace_root / "ws"
    ws.mkdir()
    async with SupervisorClient(farm.endpoint) as sv:
        sid = await sv.create_session(workspace=str(ws))
        seen: list[dict[str, Any]] = []
        end = await _turn(sv, sid, "write a file", seen)
        assert end["type"] == "turn_complete"
        types = [e["type"] for e in seen]
        assert "tool_call_begin" in types
        tool_end = next(e for e in seen if e["type"] == "tool_call_end")
        assert tool_end["payload"]["outcome"] == "ok", tool_end
        assert tool_end["payload"]["isolation"]["tier"] in ("T2", "T2-", "T1")
        assert (ws / "out.txt").read_text() == "hi\n"
        durable = [e["sequence"] for e in seen if e["sequence"] > 0]
        assert durable == list(range(1, len(durable) + 1))
        history = await sv.history(sid)
        assert [e["sequence"] for e in history["events"]] == durable


async def test_supervisor_killed_mid_turn_then_the_turn_completes(
        start_farm: Callable[..., Any], workspace_root: Path) -> None:
    script = {"responses": [
        {"tool_calls": [{"name": "shell", "arguments": {"command": "sleep 2; echo slow"}}]},
        {"text": "finished", "usage": {"input": 10, "output": 3}},
    ]}
    farm = await start_farm(script)
    ws = workspace_root / "ws"
    ws.mkdir()
    async with SupervisorClient(farm.endpoint) as sv:
        sid = await sv.create_session(workspace=str(ws))
        seen: list[dict[str, Any]] = []
        sub = await sv.submit(sid, {"type": "user_input", "text": "go"})

        async def collect() -> None:
            async for e in sv.events(sid):
                seen.append(e)

        collector = asyncio.create_task(collect())
        try:
            await eventually(lambda: _has(seen, "tool_call_begin"), timeout_s=30,
                             what="the tool call to start")
            old = farm.pid("supervisor")
            os.kill(old, signal.SIGKILL)
            await eventually(lambda: _restarted(farm, old), timeout_s=30,
                             what="the supervisor restarted")
            await eventually(lambda: _terminal(seen, sub), timeout_s=60,
                             what="the turn to end after the restart")
        finally:
            collector.cancel()
    end = next(e for e in seen if e["type"] in ("turn_complete", "turn_aborted")
               and e.get("submission_id") == sub)
    assert end["type"] == "turn_complete", end
    durable = [e["sequence"] for e in seen if e["sequence"] > 0]
    assert durable == list(range(1, len(durable) + 1)), "gap or duplicate across the restart"
    ends = [e for e in seen if e["type"] == "tool_call_end"]
    assert len(ends) == 1
    assert ends[0]["payload"]["outcome"] in ("ok", "unknown")


async def _has(seen: list[dict[str, Any]], kind: str) -> bool:
    return any(e["type"] == kind for e in seen)


async def _restarted(farm: Any, old: int) -> bool:
    child = farm.farm.tree.children["supervisor"]
    return child.pid != old and child.state == "running"


async def _terminal(seen: list[dict[str, Any]], sub: str) -> bool:
    return any(e.get("submission_id") == sub and e["type"] in ("turn_complete", "turn_aborted")
               for e in seen)
