"""Turn mechanics: parallel dispatch, step limits, the compact op with a
summary compaction, set_model, queued input, and slow subscribers.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from supervisor.engine import SubscriberDropped
from supervisor.store.records import EventRecord
from tests.engine.farm import FarmPool, engine, start_farm, types
from tests.helpers import Procs, eventually

# The farms' brokers and workers are shared by the module (conftest.py's
# ``farm_pool``), also under xdist (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("engine-turns")


@pytest.mark.sandbox
async def test_parallel_calls_of_one_step_run_concurrently_on_several_workers(
        procs: Procs, tmp_path: Path) -> None:
    # each command can only finish once the other has started: they must overlap
    wait_for = ("touch {me}; for i in $(seq 200); do [ -e {other} ] && echo {me} && exit 0; "
                "sleep 0.05; done; echo alone; exit 1")
    script = {"responses": [
        {"tool_calls": [
            {"name": "shell", "call_id": "a",
             "arguments": {"command": wait_for.format(me="a.on", other="b.on")}},
            {"name": "shell", "call_id": "b",
             "arguments": {"command": wait_for.format(me="b.on", other="a.on")}}]},
        {"text": "both ran"}]}
    farm = start_farm(procs, tmp_path, script, workers=2, capacity=1)
    async with engine(farm) as eng:
        sid = await eng.session(approval="allow")
        events = await eng.run_until(sid, {"type": "user_input", "text": "go"})
        assert events[-1].type == "turn_complete"
        ends = [e.payload for e in events if e.type == "tool_call_end"]
        assert sorted(p["output"].strip() for p in ends) == ["a.on", "b.on"]
        assert all(p["outcome"] == "ok" for p in ends)
        tiers = {p["isolation"]["tier"] for p in ends}
        execution = (await eng.store.executions_page(sid, limit=1)).items[0]
        assert (execution.tool_calls, execution.failed_tool_calls) == (2, 0)
        assert execution.sandbox_tier in tiers  # the record says what the calls ran under


@pytest.mark.sandbox
async def test_a_call_id_given_twice_in_one_step_runs_both_calls_apart(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    script = {"responses": [
        {"tool_calls": [
            {"name": "shell", "call_id": "dup", "arguments": {"command": "echo first"}},
            {"name": "shell", "call_id": "dup", "arguments": {"command": "echo second"}}]},
        {"text": "done"}]}
    farm = farm_pool.farm(procs, tmp_path, script)
    async with engine(farm) as eng:
        sid = await eng.session(approval="allow")
        events = await eng.run_until(sid, {"type": "user_input", "text": "go"})
        assert events[-1].type == "turn_complete"
        ends = {e.payload["call_id"]: e.payload["output"].strip()
                for e in events if e.type == "tool_call_end"}
        (warning,) = [e.payload for e in events if e.type == "warning"]
        fresh = warning["renamed_to"]
        assert warning["call_id"] == "dup"
        assert fresh != "dup"
        assert ends == {"dup": "first", fresh: "second"}
        # The next request carries each call with its own output.
        body = farm.llm_requests()[-1]["body"]
        pairs = {(i["type"], i["call_id"]) for i in body["input"]
                 if i.get("type") in ("function_call", "function_call_output")}
        assert pairs == {("function_call", "dup"), ("function_call_output", "dup"),
                         ("function_call", fresh), ("function_call_output", fresh)}


async def test_model_step_limit_fails_the_turn(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    call = {"tool_calls": [{"name": "teleport", "arguments": {}}]}
    farm = farm_pool.farm(procs, tmp_path, {"responses": [call] * 10}, services="model")
    async with engine(farm, max_model_steps=3) as eng:
        sid = await eng.session(approval="allow")
        events = await eng.run_until(sid, {"type": "user_input", "text": "loop"})
        assert events[-1].type == "turn_aborted"
        assert events[-1].payload["reason"] == "failed"
        assert types(events).count("model_step_started") == 3
        error = next(e for e in events if e.type == "error")
        assert error.payload["kind"] == "turn_limit"


async def test_compact_op_with_summary_compaction_and_set_model(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    farm = farm_pool.farm(procs, tmp_path, {"responses": [{"text": "first answer"},
                                                      {"text": "THE SUMMARY"}]},
                      services="model")
    routes = {"main": farm.route("main", native_compaction=False),
              "alternate": farm.route("alternate", native_compaction=False)}
    async with engine(farm, routes=routes) as eng:
        sid = await eng.session()
        first = await eng.run_until(sid, {"type": "user_input", "text": "hello"})
        assert first[-1].type == "turn_complete"
        compacted = await eng.run_until(sid, {"type": "compact"},
                                        after_sequence=first[-1].sequence)
        assert compacted[-1].type == "turn_complete"
        assert types(compacted).count("context_compacted") == 1
        saved = await eng.store.load(sid)
        assert saved is not None
        assert saved.state.compaction_count == 1
        assert saved.context[0] == {"type": "compaction", "summary": "THE SUMMARY"}
        assert saved.context[1]["role"] == "user"  # recent user message kept verbatim
        assert all(i.get("role") != "assistant" for i in saved.context)
        await eng.manager.submit(sid, {"type": "set_model", "route": "alternate"})
        again = await eng.run_until(sid, {"type": "user_input", "text": "more"},
                                    after_sequence=compacted[-1].sequence)
        started = [e for e in again if e.type == "model_step_started"]
        assert [e.payload["route"] for e in started] == ["alternate"]
        diag = next(e for e in again if e.type == "model_step_completed")
        assert diag.payload["diagnostics"]["prompt_cache"]["outcome"] == "context_rewrite"


async def test_input_during_a_turn_is_queued_durably_and_runs_next(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    farm = farm_pool.farm(procs, tmp_path, {"responses": [{"text": "slow", "delay_s": 0.5},
                                                      {"text": "second"}]}, services="model")
    async with engine(farm) as eng:
        sid = await eng.session()
        it = eng.manager.subscribe(sid)
        first = await eng.manager.submit(sid, {"type": "user_input", "text": "one"})
        second = None
        completes: list[str | None] = []
        async with asyncio.timeout(20):
            async for e in it:
                if e.type == "model_step_started" and second is None:
                    second = await eng.manager.submit(sid, {"type": "user_input",
                                                            "text": "two"})
                    loaded = await eng.store.load(sid)
                    assert loaded is not None
                    assert [q["text"] for q in loaded.state.queued_input] == ["two"]
                if e.type == "turn_complete":
                    completes.append(e.submission_id)
                    if len(completes) == 2:
                        break
        await it.aclose()  # type: ignore[attr-defined]
        assert completes == [first, second]


async def test_a_slow_subscriber_is_dropped_and_resumes_without_a_gap(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    farm = farm_pool.farm(procs, tmp_path, {"responses": [{"text": "x"}] * 20}, services="model")
    async with engine(farm, subscriber_queue=4) as eng:
        sid = await eng.session()
        session = eng.manager.sessions[sid]
        slow = eng.manager.subscribe(sid)
        got: list[EventRecord] = [await slow.__anext__()]  # registered, then it stalls

        async def idle() -> bool:
            return session.driver is None and not session.state.queued_input

        for i in range(3):
            await eng.manager.submit(sid, {"type": "user_input", "text": f"t{i}"})
            await eventually(idle, timeout_s=20, what="the turn to finish")

        async def drain() -> None:
            async for e in slow:
                got.append(e)

        with pytest.raises(SubscriberDropped) as dropped:
            await drain()
        got = [e for e in got if e.sequence > 0]  # live-only deltas carry no sequence
        last = dropped.value.last_sequence
        assert last == got[-1].sequence
        replay = await eng.store.replay_events(sid)
        assert last < replay[-1].sequence
        rest: list[EventRecord] = []
        again = eng.manager.subscribe(sid, after_sequence=last)
        async with asyncio.timeout(10):
            async for e in again:
                if e.sequence > 0:
                    rest.append(e)
                if e.sequence == replay[-1].sequence:
                    break
        await again.aclose()  # type: ignore[attr-defined]
        assert [e.sequence for e in got + rest] == [e.sequence for e in replay]


async def test_an_idle_session_drops_its_context_and_reloads_it_from_the_store(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    farm = farm_pool.farm(procs, tmp_path, {"responses": [{"text": "first"}, {"text": "second"}]},
                      services="model")
    async with engine(farm, idle_context_items=0) as eng:
        sid = await eng.session()
        first = await eng.run_until(sid, {"type": "user_input", "text": "one"})
        session = eng.manager.sessions[sid]

        async def idle() -> bool:
            return session.driver is None

        await eventually(idle, timeout_s=10, what="the session to go idle")
        assert session.context_evicted
        assert session.context == []
        assert (await eng.manager.describe(sid))["context_items"] == 2
        second = await eng.run_until(sid, {"type": "user_input", "text": "two"},
                                     after_sequence=first[-1].sequence)
        assert second[-1].payload["last_agent_message"] == "second"  # k = 1: history reloaded
        sent = farm.llm_requests()[-1]["body"]["input"]
        assert [i.get("role") for i in sent] == ["user", "assistant", "user"]


async def test_an_input_too_large_for_the_queue_is_a_typed_refusal(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    # Queued input lives in the bounded state row: 1,000,000 quote characters are
    # 2 MB as stored (each one escaped). Before, the store refused the state row
    # (RecordTooLarge from submit); now it is BadOp and the session goes on.
    from supervisor.engine import BadOp

    farm = farm_pool.farm(procs, tmp_path, {"responses": [{"text": "fine"}]})
    async with engine(farm) as eng:
        sid = await eng.session()
        with pytest.raises(BadOp, match="queues at most 262144 bytes"):
            await eng.manager.submit(sid, {"type": "user_input", "text": '"' * 1_000_000})
        events = await eng.run_until(sid, {"type": "user_input", "text": "hi"})
        assert events[-1].type == "turn_complete"
        assert [e.payload["text"] for e in events if e.type == "agent_message"] == ["fine"]
