"""A whole farm on the PostgreSQL store (``[store] url``): a turn with a sandboxed tool
call, the supervisor SIGKILLed mid-turn, restarted, and the turn completing from what
PostgreSQL holds: the same run as test_farm_e2e's on SQLite."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from supervisor.client import SupervisorClient
from tests.farm.test_farm_e2e import _has, _restarted, _terminal
from tests.helpers import eventually

pytestmark = pytest.mark.timeout(180)


async def test_a_farm_on_postgresql_survives_its_supervisor_killed_mid_turn(
        start_farm: Callable[..., Any], workspace_root: Path, pg_server: Any) -> None:
    url = pg_server.new_database()
    script = {"responses": [
        {"tool_calls": [{"name": "shell", "arguments": {"command": "sleep 2; echo slow"}}]},
        {"text": "finished", "usage": {"input": 10, "output": 3}},
    ]}
    try:
        farm = await start_farm(script, extra=f'[store]\nurl = "{url}"\n')
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
            history = await sv.history(sid)
        end = next(e for e in seen if e["type"] in ("turn_complete", "turn_aborted")
                   and e.get("submission_id") == sub)
        assert end["type"] == "turn_complete", end
        durable = [e["sequence"] for e in seen if e["sequence"] > 0]
        assert durable == list(range(1, len(durable) + 1)), "gap or duplicate"
        assert [e["sequence"] for e in history["events"]] == durable
        assert not (farm.home / "corral.db").exists()  # the state went to PostgreSQL
        rows = pg_server.psql("SELECT count(*) FROM events", database=url.rsplit("/", 1)[1])
        assert int(rows) == len(durable)
    finally:
        pg_server.drop_database(url)
