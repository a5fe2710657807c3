"""The 11 möbius runtime scenarios (seeds/000), in our terms.

The session engine (``SessionManager``) runs in the test process; the model
calls go through a real broker and a real worker process to the scripted
provider over HTTP; state is a real SQLite store. The möbius ``model.responses``
and ``model.compactions`` counters are the provider's request counts.
"""

from __future__ import annotations

import asyncio
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
pytestmark = pytest.mark.xdist_group("engine-mobius")

USAGE = {"input": 5, "output": 3}


def mw(*middlewares: Middleware) -> Any:
    return lambda spec: list(middlewares)


def of_sub(events: list[EventRecord], sub: str | None) -> list[EventRecord]:
    return [e for e in events if e.submission_id == sub]


async def checkpoint_text(eng: Engine, sid: str) -> str:
    """Everything the store holds for a session, as one string."""
    loaded = await eng.store.load(sid)  # type: ignore[arg-type]
    assert loaded is not None
    events = await eng.store.replay_events(sid)  # type: ignore[arg-type]
    execs = await eng.store.executions_page(sid, limit=50)  # type: ignore[arg-type]
    batches = await eng.store.transcript_page(sid, max_batches=1000)  # type: ignore[arg-type]
    return json.dumps({
        "state": loaded.state.to_json(), "context": loaded.context,
        "events": [(e.type, e.payload) for e in events],
        "executions": [repr(x) for x in execs.items],
        "transcript": [b.items for b in batches.items], "config": loaded.record.config,
    }, default=str)


# 1 ---------------------------------------------------------------------------

class StoppingSessionStart(Middleware):
    name = "stopping_session_start"

    async def session_start(self, inp: HookInput) -> HookResult | None:
        return HookResult(stop="session-start hook stopped the session")


async def test_idle_session_start_stop_does_not_consume_the_next_prompt(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    farm = farm_pool.farm(procs, tmp_path, {"responses": [{"text": "one"}, {"text": "two"}]},
                      services="model")
    async with engine(farm, middleware=mw(StoppingSessionStart())) as eng:
        sid = await eng.session()
        events = await eng.run_until(sid, {"type": "user_input", "text": "first"})
        assert events[-1].type == "turn_complete"
        assert farm.model_responses() == 1
        assert any(e.type == "warning" and "session-start" in e.payload["message"]
                   for e in events)


# 2 ---------------------------------------------------------------------------

class RejectFirstPrompt(Middleware):
    name = "reject_first_prompt"

    def __init__(self) -> None:
        self.rejected = False

    async def user_prompt_submit(self, inp: HookInput) -> HookResult | None:
        if not self.rejected and inp.data["attachments"]:
            self.rejected = True
            return HookResult(reject="attachments are not allowed here")
        return None


async def test_rejected_prompt_aborts_without_persisting_or_wedging_the_next_turn(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    farm = farm_pool.farm(procs, tmp_path, {"responses": [{"text": "fine"}]}, services="model")
    secret, attachment_id = "do not persist this secret", "da913625-36d8-4624-815f-5523eb93b95f"
    async with engine(farm, middleware=mw(RejectFirstPrompt())) as eng:
        sid = await eng.session()
        it = eng.manager.subscribe(sid)
        sub = await eng.manager.submit(sid, {
            "type": "user_input", "text": secret,
            "attachments": [{"id": attachment_id, "name": "secret.txt", "size": 6,
                             "media_type": "text/plain"}]})
        mine: list[EventRecord] = []
        async with asyncio.timeout(20):
            async for e in it:
                if e.submission_id == sub:
                    mine.append(e)
                    if e.type == "turn_aborted":
                        break
        await it.aclose()  # type: ignore[attr-defined]
        assert "turn_started" in types(mine)
        assert mine[-1].type == "turn_aborted"
        assert mine[-1].payload["reason"] == "rejected"
        assert not {"agent_message", "model_step_started", "turn_complete",
                    "user_message"} & set(types(mine))
        saved = await checkpoint_text(eng, sid)
        assert secret not in saved
        assert attachment_id not in saved
        # the database files (main + WAL) never saw them either
        raw = await asyncio.to_thread(
            lambda: b"".join(p.read_bytes() for p in tmp_path.glob("engine.sqlite3*")))
        assert secret.encode() not in raw
        assert attachment_id.encode() not in raw
        events = await eng.run_until(sid, {"type": "user_input", "text": "continue"})
        assert events[-1].type == "turn_complete"
        assert farm.model_responses() == 1


# 3 ---------------------------------------------------------------------------

class ToolHookContext(Middleware):
    name = "tool_hook_context"

    async def pre_tool(self, inp: HookInput) -> HookResult | None:
        return HookResult(context=f"pre-tool context for {inp.data['call_id']}")

    async def post_tool(self, inp: HookInput) -> HookResult | None:
        return HookResult(context=f"post-tool context for {inp.data['call_id']}")


def kind(item: dict[str, Any]) -> str | None:
    meta = item.get("corral")
    return meta.get("kind") if isinstance(meta, dict) else None


async def test_pre_tool_hook_context_is_durable_before_open_call_at_approval(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    script = {"responses": [{"tool_calls": [{"name": "shell", "call_id": "call-1",
                                             "arguments": {"command": "echo hi"}}]},
                            {"text": "done"}]}
    farm = farm_pool.farm(procs, tmp_path, script, services="model")
    async with engine(farm, middleware=mw(ToolHookContext())) as eng:
        sid = await eng.session(approval="ask")
        await eng.run_until(sid, {"type": "user_input", "text": "run it"},
                            until=lambda e: e.type == "exec_approval_request")
        saved = await eng.store.load(sid)
        assert saved is not None
        ctx = saved.context
        call = next(i for i, item in enumerate(ctx) if item.get("type") == "function_call")
        pre = next(i for i, item in enumerate(ctx) if kind(item) == "pre_tool_hook")
        assert (pre + 1, saved.state.pending_approval is not None) == (call, True)


# 4 ---------------------------------------------------------------------------

class RecordRequests(Middleware):
    name = "record_requests"

    def __init__(self) -> None:
        self.inputs: list[list[dict[str, Any]]] = []

    async def model_request(self, inp: HookInput) -> HookResult | None:
        self.inputs.append(list(inp.data["request"]["items"]))
        return None


@pytest.mark.sandbox
async def test_post_tool_hook_context_follows_only_executed_tool_outputs(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    script = {"responses": [
        {"tool_calls": [
            {"name": "shell", "call_id": "call-1", "arguments": {"command": "echo one"}},
            {"name": "missing", "call_id": "call-2", "arguments": {}},
            {"name": "shell", "call_id": "call-3", "arguments": {"command": "echo three"}}]},
        {"text": "done"}]}
    farm = farm_pool.farm(procs, tmp_path, script, workers=2)
    recorder = RecordRequests()
    async with engine(farm, middleware=mw(ToolHookContext(), recorder)) as eng:
        sid = await eng.session(approval="allow")
        events = await eng.run_until(sid, {"type": "user_input", "text": "run it"})
        assert events[-1].type == "turn_complete", [(e.type, e.payload) for e in events]
        ends = [e.payload["call_id"] for e in events if e.type == "tool_call_end"]
        outcomes = {e.payload["call_id"]: (e.payload["outcome"], e.payload["output"].strip())
                    for e in events if e.type == "tool_call_end"}
        assert outcomes["call-1"] == ("ok", "one")  # really ran, in the sandbox
        assert outcomes["call-3"] == ("ok", "three")
        assert outcomes["call-2"][0] == "missing"
        second = recorder.inputs[1]
        seq: list[tuple[str, str | None]] = []
        for item in second:
            k = kind(item)
            if k in ("pre_tool_hook", "post_tool_hook"):
                seq.append((k, None))
            elif item.get("type") in ("function_call", "function_call_output"):
                seq.append((item["type"], item["call_id"]))
        assert ends[0] == "call-2"  # the missing tool answers at once, without running
        expected: list[tuple[str, str | None]] = [
            ("pre_tool_hook", None), ("pre_tool_hook", None),
            ("function_call", "call-1"), ("function_call", "call-2"),
            ("function_call", "call-3")]
        for call_id in ends:  # outputs in completion order
            expected.append(("function_call_output", call_id))
            if call_id != "call-2":
                expected.append(("post_tool_hook", None))
        assert seq == expected


# 5 ---------------------------------------------------------------------------

class StoppingCompaction(Middleware):
    name = "stopping_compaction"

    def __init__(self, boundary: str) -> None:
        self.boundary = boundary

    async def pre_compact(self, inp: HookInput) -> HookResult | None:
        return HookResult(stop="pre-compact hook stopped the turn") \
            if self.boundary == "before" else None

    async def post_compact(self, inp: HookInput) -> HookResult | None:
        return HookResult(stop="post-compact hook stopped the turn") \
            if self.boundary == "after" else None

    async def session_start(self, inp: HookInput) -> HookResult | None:
        if self.boundary == "session_start" and inp.data["source"] == "compact":
            return HookResult(stop="session-start hook stopped the turn")
        return None


@pytest.mark.parametrize(("boundary", "compactions", "reason"), [
    ("before", 0, "pre-compact hook stopped the turn"),
    ("after", 1, "post-compact hook stopped the turn"),
    ("session_start", 1, "session-start hook stopped the turn"),
])
async def test_compaction_stops(procs: Procs, farm_pool: FarmPool, tmp_path: Path, boundary: str,
                                compactions: int, reason: str) -> None:
    farm = farm_pool.farm(procs, tmp_path, {"responses": [{"text": "done"}],
                                        "compact": {"usage": USAGE}}, services="model")
    async with engine(farm, middleware=mw(StoppingCompaction(boundary)),
                      compaction_threshold_tokens=1) as eng:
        sid = await eng.session()
        events = await eng.run_until(sid, {"type": "user_input", "text": "hello"})
        assert events[-1].type == "turn_complete"
        warnings = [e.payload["message"] for e in events if e.type == "warning"]
        counts = [e.payload for e in events if e.type == "token_count"]
        saved = await eng.store.load(sid)
        assert saved is not None
        assert (farm.model_responses(), farm.compactions(), saved.state.compaction_count,
                reason in warnings) == (0, compactions, compactions, True)
        assert saved.state.last_usage is None
        if compactions:
            last = counts[-1]
            assert (last["last"]["input"], last["last"]["output"]) == (5, 3)
            assert last["total"] == saved.state.total_usage
        else:
            assert counts == []
            assert saved.state.total_usage["total"] == 0


# 6 ---------------------------------------------------------------------------

TITLES = {"success": "Context compacted", "failure": "Context compaction failed",
          "interrupt": "Context compaction cancelled"}


@pytest.mark.parametrize("outcome", ["success", "failure", "interrupt"])
async def test_compaction_notice_is_live_and_closes_on_success_failure_and_interrupt(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path, outcome: str) -> None:
    compact: dict[str, Any] = {"success": {"usage": USAGE, "delay_s": 0.2},
                               "failure": {"status": 400, "error_message": "compaction failed"},
                               "interrupt": {"hang": True}}[outcome]
    farm = farm_pool.farm(procs, tmp_path, {"responses": [{"text": "done"}], "compact": compact},
                      services="model")
    async with engine(farm, compaction_threshold_tokens=1) as eng:
        sid = await eng.session()
        it = eng.manager.subscribe(sid)
        await eng.manager.submit(sid, {"type": "user_input", "text": "compact this"})
        turn_id = None
        pending = None
        completions = 0
        compacted = 0
        async with asyncio.timeout(20):
            async for e in it:
                if e.type == "turn_started":
                    turn_id = e.payload["turn_id"]
                if e.type == "frontend_render" and e.payload["capability"] == "compaction":
                    block = e.payload["block"]
                    if pending is None:
                        pending = block
                        assert (block["title"], block["state"]) == ("Context compacting",
                                                                    "pending")
                        assert block["id"]
                        if outcome == "interrupt":
                            await eng.manager.submit(sid, {"type": "interrupt",
                                                           "turn_id": turn_id})
                    else:
                        assert block["id"] == pending["id"]
                        assert block["state"] == "complete"
                        assert block["title"] == TITLES[outcome]
                        completions += 1
                if e.type == "context_compacted":
                    compacted += 1
                if e.type in ("turn_complete", "turn_aborted"):
                    break
        await it.aclose()  # type: ignore[attr-defined]
        assert completions == 1
        assert compacted == (outcome == "success")
        saved = await eng.store.load(sid)
        assert saved is not None
        assert saved.state.compaction_count == (outcome == "success")


# 7 ---------------------------------------------------------------------------

class LaterHook(Middleware):
    name = "later_hook"

    def __init__(self, request: bool, fail: bool) -> None:
        self.request = request
        self.fail = fail
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def _run(self) -> None:
        self.entered.set()
        if self.fail:
            raise RuntimeError("later preparation hook failed")
        await self.release.wait()

    async def pre_model(self, inp: HookInput) -> HookResult | None:
        if not self.request:
            await self._run()
        return None

    async def model_request(self, inp: HookInput) -> HookResult | None:
        if self.request:
            await self._run()
        return None


@pytest.mark.parametrize("request_hook", [False, True], ids=["pre_model", "model_request"])
@pytest.mark.parametrize("outcome", ["failure", "interrupt", "success"])
async def test_compaction_notice_waits_for_later_preparation_hooks_to_settle(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path, request_hook: bool,
        outcome: str) -> None:
    farm = farm_pool.farm(procs, tmp_path, {"responses": [{"text": "done"}],
                                        "compact": {"usage": USAGE}}, services="model")
    later = LaterHook(request_hook, outcome == "failure")
    async with engine(farm, middleware=mw(later), compaction_threshold_tokens=1) as eng:
        sid = await eng.session()
        it = eng.manager.subscribe(sid)
        await eng.manager.submit(sid, {"type": "user_input", "text": "compact this"})
        turn_id = None
        pending = None
        completions = 0
        async with asyncio.timeout(20):
            async for e in it:
                if e.type == "turn_started":
                    turn_id = e.payload["turn_id"]
                if e.type == "frontend_render" and e.payload["capability"] == "compaction":
                    if pending is None:
                        pending = e.payload["block"]
                        assert pending["state"] == "pending"
                        await later.entered.wait()
                        assert farm.compactions() == 1
                        if outcome != "failure":
                            saved = await eng.store.load(sid)
                            assert saved is not None
                            assert saved.state.compaction_count == 0, "provisional"
                            stored = await eng.store.replay_events(sid)
                            assert stored[-1].type == "frontend_render"
                            assert stored[-1].payload["block"]["state"] == "pending", \
                                "the pending notice remains open until preparation settles"
                            if outcome == "interrupt":
                                await eng.manager.submit(sid, {"type": "interrupt",
                                                               "turn_id": turn_id})
                            else:
                                later.release.set()
                        continue
                    block = e.payload["block"]
                    assert block["id"] == pending["id"]
                    assert block["state"] == "complete"
                    assert block["title"] == TITLES[outcome]
                    saved = await eng.store.load(sid)
                    assert saved is not None
                    assert saved.state.compaction_count == (outcome == "success")
                    completions += 1
                if e.type in ("turn_complete", "turn_aborted"):
                    break
        await it.aclose()  # type: ignore[attr-defined]
        assert completions == 1, "the notice closes once, before the terminal turn event"
        saved = await eng.store.load(sid)
        assert saved is not None
        assert saved.state.compaction_count == (outcome == "success")
        assert saved.state.context_epoch == (outcome == "success")
        replayed = await eng.store.replay_events(sid)
        assert types(replayed).count("context_compacted") == (outcome == "success")


# 8 ---------------------------------------------------------------------------

async def test_compaction_marker_survives_transcript_replay(procs: Procs, farm_pool: FarmPool,
                                                            tmp_path: Path) -> None:
    farm = farm_pool.farm(procs, tmp_path, {"responses": [{"text": "done"}],
                                        "compact": {"usage": USAGE}}, services="model")
    recorder = RecordRequests()
    async with engine(farm, middleware=mw(recorder), compaction_threshold_tokens=1) as eng:
        sid = await eng.session()
        events = await eng.run_until(sid, {"type": "user_input", "text": "hello"})
        assert events[-1].type == "turn_complete"
        live_markers = sum(1 for e in events if e.type == "frontend_render"
                           and e.payload["block"]["state"] == "complete")
        completed = [e for e in events if e.type == "model_step_completed"][-1]
        saved = await eng.store.load(sid)
        assert saved is not None
        replayed = await eng.store.replay_events(sid)
        assert live_markers == 1
        assert saved.state.context_epoch == 1
        assert saved.state.compaction_count == 1
        assert saved.state.last_rewrite is not None
        assert saved.state.last_rewrite["reasons"] == ["compaction"]
        sent = recorder.inputs[-1]
        marks = [i for i in sent if (i.get("corral") or {}).get("cache_breakpoint") is True]
        assert len(marks) == 1
        assert saved.state.cache_breakpoint is not None
        assert saved.state.cache_breakpoint < len(saved.context)
        cache = completed.payload["diagnostics"]["prompt_cache"]
        assert cache == {"context_epoch": 1, "outcome": "context_rewrite",
                         "rewrite_reasons": ["compaction"]}
        assert types(replayed).count("context_compacted") == 1
        assert saved.context[0]["type"] == "compaction"


# 9 ---------------------------------------------------------------------------

async def test_provider_failure_records_one_failed_execution(procs: Procs, farm_pool: FarmPool,
                                                             tmp_path: Path) -> None:
    farm = farm_pool.farm(procs, tmp_path, {"responses": [{"status": 400,
                                                       "error_message": "bad request"}]},
                      services="model")
    async with engine(farm) as eng:
        sid = await eng.session()
        events = await eng.run_until(sid, {"type": "user_input", "text": "fail"})
        assert events[-1].type == "turn_aborted"
        assert events[-1].payload["reason"] == "failed"
        page = await eng.store.executions_page(sid, limit=1)
        execution = page.items[0]
        assert (execution.outcome, execution.model_calls, execution.tool_calls) == (
            "failed", 1, 0)


# 10 --------------------------------------------------------------------------

async def test_child_session_route_and_route_aware_usage_observer(procs: Procs, farm_pool: FarmPool,
                                                                  tmp_path: Path) -> None:
    farm = farm_pool.farm(procs, tmp_path, {"responses": [{"text": "done",
                                                       "usage": {"input": 1}}]},
                      services="model")
    observed: list[tuple[str, int]] = []

    def observer(route: str, usage: Any) -> None:
        observed.append((route, usage["total"]))

    routes = {"main": farm.route("main"), "alternate": farm.route("alternate")}
    async with engine(farm, routes=routes, usage_observer=observer) as eng:
        parent = await eng.session(child_route="alternate")
        child = await eng.session(parent_session_id=parent)
        events = await eng.run_until(child, {"type": "user_input", "text": "hello"})
        assert events[-1].type == "turn_complete"
        saved = await eng.store.load(child)
        assert saved is not None
        assert observed == [("alternate", saved.state.total_usage["total"])]
        assert observed[0][1] >= 1
        started = [e for e in events if e.type == "model_step_started"]
        assert started[0].payload["route"] == "alternate"


# 11 --------------------------------------------------------------------------

async def test_failing_usage_observer_aborts_before_checkpoint_usage_is_committed(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    farm = farm_pool.farm(procs, tmp_path, {"responses": [{"text": "done"}]}, services="model")

    def observer(route: str, usage: Any) -> None:
        raise RuntimeError("usage sink failed")

    async with engine(farm, usage_observer=observer) as eng:
        sid = await eng.session()
        events = await eng.run_until(sid, {"type": "user_input", "text": "hello"})
        assert events[-1].type == "turn_aborted"
        saved = await eng.store.load(sid)
        assert saved is not None
        execution = (await eng.store.executions_page(sid, limit=1)).items[0]
        assert set(saved.state.total_usage.values()) == {0}
        assert saved.state.last_usage is None
        assert execution.outcome == "failed"
        assert execution.model_calls == 1
        assert set(execution.usage.values()) == {0}
