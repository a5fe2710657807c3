"""call_ids a provider reuses across steps and turns: some OpenAI-compatible
servers number the calls of every response ``call_0``, ``call_1``... A call_id
already held by a ``function_call`` in the session's context runs under a fresh
id, with a warning, so each output pairs with its own call; after a compaction
dropped the earlier call from the context, the id is free again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from supervisor.engine import HookInput, HookResult, Middleware
from supervisor.store.records import EventRecord
from tests.engine.farm import Engine, FarmPool, engine, types
from tests.helpers import Procs

# The farms' brokers and workers are shared by the module (conftest.py's
# ``farm_pool``), also under xdist (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("engine-call-ids")


def echo(word: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "shell", "call_id": "call_0",
                            "arguments": {"command": f"echo {word}"}}]}


def check_pairs(items: list[dict[str, Any]]) -> dict[str, str]:
    """Every call_id is unique among the calls, has exactly one output, and that
    output is the one its own command printed. Returns call_id -> word."""
    calls = [i for i in items if i.get("type") == "function_call"]
    outputs = [i for i in items if i.get("type") == "function_call_output"]
    ids = [c["call_id"] for c in calls]
    assert len(set(ids)) == len(ids), ids
    assert sorted(o["call_id"] for o in outputs) == sorted(ids)
    words = {c["call_id"]: json.loads(c["arguments"])["command"].removeprefix("echo ")
             for c in calls}
    for o in outputs:
        assert o["output"].strip() == words[o["call_id"]], (o, words)
    return words


async def turn(eng: Engine, sid: str, text: str, after: int) -> list[EventRecord]:
    events = await eng.run_until(sid, {"type": "user_input", "text": text},  # type: ignore[arg-type]
                                 after_sequence=after)
    assert events[-1].type == "turn_complete", [(e.type, e.payload) for e in events]
    return events


def ends(events: list[EventRecord]) -> dict[str, str]:
    return {e.payload["call_id"]: e.payload["output"].strip()
            for e in events if e.type == "tool_call_end"}


def renames(events: list[EventRecord]) -> list[tuple[str, str]]:
    return [(e.payload["call_id"], e.payload["renamed_to"])
            for e in events if e.type == "warning" and "renamed_to" in e.payload]


@pytest.mark.sandbox
async def test_a_call_id_reused_by_later_steps_turns_and_after_a_restart_is_renamed(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    script = {"responses": [echo("one"), echo("two"), {"text": "turn one done"},
                            echo("three"), {"text": "turn two done"},
                            echo("four"), {"text": "turn three done"}]}
    farm = farm_pool.farm(procs, tmp_path, script)
    db = tmp_path / "ids.sqlite3"
    async with engine(farm, db=db) as eng:
        sid = await eng.session(approval="allow")
        first = await turn(eng, sid, "one", 0)
        # step 2 of the same turn gave call_0 again: it ran as a fresh id
        ((old, fresh_two),) = renames(first)
        assert old == "call_0"
        assert fresh_two != "call_0"
        assert ends(first) == {"call_0": "one", fresh_two: "two"}
        warning = next(e.payload for e in first if e.type == "warning")
        assert "earlier call" in warning["message"]
        # the model's next request already carries the renamed id, paired
        body = farm.llm_requests()[-1]["body"]
        assert check_pairs(body["input"]) == {"call_0": "one", fresh_two: "two"}

        second = await turn(eng, sid, "two", first[-1].sequence)
        ((old, fresh_three),) = renames(second)
        assert old == "call_0"
        assert fresh_three not in ("call_0", fresh_two)
        assert ends(second) == {fresh_three: "three"}
        last = second[-1].sequence
    # a new supervisor on the same store: the taken ids come from the loaded context
    async with engine(farm, db=db) as eng2:
        third = await turn(eng2, sid, "three", last)
        ((old, fresh_four),) = renames(third)
        assert old == "call_0"
        assert fresh_four not in ("call_0", fresh_two, fresh_three)
        assert ends(third) == {fresh_four: "four"}
        saved = await eng2.store.load(sid)
        assert saved is not None
        assert check_pairs(saved.context) == {"call_0": "one", fresh_two: "two",
                                              fresh_three: "three", fresh_four: "four"}
        body = farm.llm_requests()[-1]["body"]
        assert check_pairs(body["input"]) == check_pairs(saved.context)
        replay = await eng2.store.replay_events(sid)
        begins = [e.payload["call_id"] for e in replay if e.type == "tool_call_begin"]
        assert begins == ["call_0", fresh_two, fresh_three, fresh_four]


@pytest.mark.sandbox
async def test_a_call_id_is_free_again_once_compaction_dropped_its_call(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    script = {"responses": [echo("one"), {"text": "turn one done"},
                            echo("two"), {"text": "turn two done"}]}
    farm = farm_pool.farm(procs, tmp_path, script)
    async with engine(farm) as eng:
        sid = await eng.session(approval="allow")
        first = await turn(eng, sid, "one", 0)
        assert ends(first) == {"call_0": "one"}
        assert renames(first) == []
        compacted = await eng.run_until(sid, {"type": "compact"},
                                        after_sequence=first[-1].sequence)
        assert types(compacted).count("context_compacted") == 1
        assert eng.manager.sessions[sid].call_ids == set()
        second = await turn(eng, sid, "two", compacted[-1].sequence)
        # the provider no longer sees the first call_0: no clash, no rename
        assert renames(second) == []
        assert ends(second) == {"call_0": "two"}
        saved = await eng.store.load(sid)
        assert saved is not None
        assert check_pairs(saved.context) == {"call_0": "two"}


class InjectCall(Middleware):
    """A pre_model hook that, on the first step only, appends a finished call
    ``call_0`` (function_call + its output) to the context the model will see."""

    async def pre_model(self, inp: HookInput) -> HookResult | None:
        if inp.data["step"] != 1:
            return None
        return HookResult(append_items=[
            {"type": "function_call", "call_id": "call_0", "name": "shell",
             "arguments": json.dumps({"command": "echo injected"})},
            {"type": "function_call_output", "call_id": "call_0", "output": "injected\n"}])


@pytest.mark.sandbox
async def test_a_call_id_a_hook_added_during_a_provisional_compaction_is_taken(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    """A compaction is provisional while the step's pre_model hooks run
    (threshold 1: every step compacts first), so a call a hook adds goes into
    the provisional context only. The compaction settles before the model's
    calls are prepared, and ``Session.call_ids`` is rebuilt from the settled
    context: the hook's call_0 holds its id, and the model's runs under a
    fresh one."""
    script = {"responses": [echo("one")] * 2 + [{"text": "done"}] * 4,
              "compact": {"usage": {"input": 5, "output": 3}}}
    farm = farm_pool.farm(procs, tmp_path, script)
    hook = InjectCall()
    async with engine(farm, middleware=lambda spec: [hook],
                      compaction_threshold_tokens=1) as eng:
        sid = await eng.session(approval="allow")
        events = await turn(eng, sid, "go", 0)
        assert types(events).count("context_compacted") >= 1
        ((old, fresh),) = renames(events)
        assert old == "call_0"
        assert ends(events) == {fresh: "one"}
        # the model answered a request whose (provisional, compacted) context held
        # the hook's call_0; the next compaction then dropped both calls
        first = farm.llm_requests()[0]["body"]["input"]
        assert first[0]["type"] == "compaction"
        assert check_pairs(first) == {"call_0": "injected"}
