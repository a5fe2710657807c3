"""A whole farm on the PostgreSQL store (``[store] url``): a turn with a sandboxed tool
call, the supervisor SIGKILLed mid-turn, restarted, and the turn completing from what
PostgreSQL holds: the same run as test_farm_e2e's on SQLite."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.farm.midturn import SLOW_TOOL_SCRIPT, kill_supervisor_mid_turn

pytestmark = pytest.mark.timeout(180)


async def test_a_farm_on_postgresql_survives_its_supervisor_killed_mid_turn(
        start_farm: Callable[..., Any], workspace_root: Path, pg_server: Any) -> None:
    url = pg_server.new_database()
    try:
        farm = await start_farm(SLOW_TOOL_SCRIPT, extra=f'[store]\nurl = "{url}"\n')
        ws = workspace_root / "ws"
        ws.mkdir()
        run = await kill_supervisor_mid_turn(farm, ws)
        assert run.end["type"] == "turn_complete", run.end
        durable = run.durable
        assert durable == list(range(1, len(durable) + 1)), "gap or duplicate"
        assert [e["sequence"] for e in run.history["events"]] == durable
        assert not (farm.home / "corral.db").exists()  # the state went to PostgreSQL
        rows = pg_server.psql("SELECT count(*) FROM events", database=url.rsplit("/", 1)[1])
        assert int(rows) == len(durable)
    finally:
        pg_server.drop_database(url)
