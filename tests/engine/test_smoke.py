"""The engine end to end on real processes: a plain turn, replay equals live."""

from __future__ import annotations

from pathlib import Path

from tests.engine.farm import engine, start_farm, types
from tests.helpers import Procs


async def test_plain_turn_completes_and_replay_equals_live(procs: Procs, tmp_path: Path) -> None:
    farm = start_farm(procs, tmp_path, {"responses": [{"text": "hello there"}]},
                      services="model")
    async with engine(farm) as eng:
        sid = await eng.session()
        live = await eng.run_until(sid, {"type": "user_input", "text": "hi"})
        assert "turn_complete" in types(live)
        msg = [e for e in live if e.type == "agent_message"]
        assert msg[0].payload["text"] == "hello there"
        durable = [e for e in live if e.sequence > 0]
        replay = await eng.store.replay_events(sid)
        assert [(e.sequence, e.type) for e in replay][: len(durable)] == [
            (e.sequence, e.type) for e in durable]
        assert [e.sequence for e in replay] == list(range(1, len(replay) + 1))
