"""A whole farm end to end: the CLI's client against the real supervisor,
broker, sandbox workers and scripted provider; then the supervisor and the
broker are SIGKILLed mid-turn and the turn still completes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from supervisor.client import SupervisorClient
from tests.farm.midturn import SLOW_TOOL_SCRIPT, kill_supervisor_mid_turn

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
    farm = await start_farm(SLOW_TOOL_SCRIPT)
    ws = workspace_root / "ws"
    ws.mkdir()
    run = await kill_supervisor_mid_turn(farm, ws)
    assert run.end["type"] == "turn_complete", run.end
    assert run.durable == list(range(1, len(run.durable) + 1)), \
        "gap or duplicate across the restart"
    ends = [e for e in run.seen if e["type"] == "tool_call_end"]
    assert len(ends) == 1
    assert ends[0]["payload"]["outcome"] in ("ok", "unknown")
