"""Hook semantics beyond the möbius seeds: Python middleware and command hooks
(JSON on stdin/stdout, run as sandboxed shell calls through the tool service).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from supervisor.engine import HookInput, HookResult, Middleware
from supervisor.engine.hooks import HookEvent, HookRunner
from tests.engine.farm import FarmPool, engine, types
from tests.helpers import Procs

# The farms' brokers and workers are shared by the module (conftest.py's
# ``farm_pool``), also under xdist (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("engine-hooks")

ONE_CALL = {"responses": [
    {"tool_calls": [{"name": "shell", "call_id": "c1", "arguments": {"command": "echo real"}}]},
    {"text": "done"}, {"text": "done 2"}, {"text": "done 3"}]}


class Explodes(Middleware):
    name = "explodes"

    def __init__(self) -> None:
        self.calls = 0

    async def pre_model(self, inp: HookInput) -> HookResult | None:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("boom")
        return None


async def test_a_hook_error_fails_the_turn_cleanly_and_the_session_lives_on(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    farm = farm_pool.farm(procs, tmp_path, {"responses": [{"text": "fine"}]}, services="model")
    async with engine(farm, middleware=lambda spec: [Explodes()]) as eng:
        sid = await eng.session()
        events = await eng.run_until(sid, {"type": "user_input", "text": "one"})
        assert events[-1].type == "turn_aborted"
        assert events[-1].payload["reason"] == "failed"
        error = next(e for e in events if e.type == "error")
        assert error.payload["kind"] == "hook_failed"
        assert "boom" in error.payload["message"]
        execution = (await eng.store.executions_page(sid, limit=1)).items[0]
        assert execution.outcome == "failed"
        last = events[-1].sequence
        again = await eng.run_until(sid, {"type": "user_input", "text": "two"},
                                    after_sequence=last)
        assert again[-1].type == "turn_complete"


class Decorate(Middleware):
    name = "decorate"

    async def user_prompt_submit(self, inp: HookInput) -> HookResult | None:
        return HookResult(text=inp.data["text"] + " (enriched)", context="prompt context")

    async def pre_model(self, inp: HookInput) -> HookResult | None:
        if inp.data["step"] == 1:
            return HookResult(context="durable pre-model context")
        return None

    async def model_request(self, inp: HookInput) -> HookResult | None:
        inp.data["request"]["instructions"] += " REQUEST-ONLY"
        inp.data["request"]["items"] = [*inp.data["request"]["items"], {
            "type": "message", "role": "developer",
            "content": [{"type": "input_text", "text": "ephemeral decoration"}]}]
        return None

    async def stop(self, inp: HookInput) -> HookResult | None:
        return HookResult(continue_with="keep going once more")


async def test_enrich_durable_context_request_only_decoration_and_bounded_stop(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    farm = farm_pool.farm(procs, tmp_path, {"responses": [{"text": "a"}, {"text": "b"},
                                                      {"text": "c"}]}, services="model")
    async with engine(farm, middleware=lambda spec: [Decorate()]) as eng:
        sid = await eng.session()
        events = await eng.run_until(sid, {"type": "user_input", "text": "hi"})
        assert events[-1].type == "turn_complete"
        # the stop hook asked every time; only one continuation is granted
        assert types(events).count("model_step_started") == 2
        user = next(e for e in events if e.type == "user_message")
        assert user.payload["text"] == "hi (enriched)"
        saved = await eng.store.load(sid)
        assert saved is not None
        kinds = [(i.get("corral") or {}).get("kind") for i in saved.context]
        assert kinds.count("user_prompt_hook") == 1
        assert kinds.count("pre_model_hook") == 1
        assert kinds.count("stop_hook") == 1
        text = str(saved.context)
        assert "ephemeral decoration" not in text  # model_request is never persisted
        sent = farm.llm_requests()
        assert "REQUEST-ONLY" in str(sent[0]["body"])
        assert "ephemeral decoration" in str(sent[0]["body"])


def test_runner_folds_in_declared_order() -> None:
    import asyncio

    seen: list[str] = []

    class Rewriter(Middleware):
        def __init__(self, name: str, args: dict[str, Any] | None, deny: str | None) -> None:
            self.name = name
            self.args = args
            self.deny_reason = deny

        async def pre_tool(self, inp: HookInput) -> HookResult | None:
            seen.append(f"{self.name}:{inp.data['arguments']}")
            return HookResult(arguments=self.args, deny=self.deny_reason)

    runner = HookRunner([Rewriter("a", {"command": "x"}, None),
                         Rewriter("b", None, "no"), Rewriter("c", {"command": "y"}, None)])
    folded = asyncio.run(runner.run(HookEvent.PRE_TOOL, "s", "t",
                                    {"arguments": {"command": "orig"}}))
    assert seen == ["a:{'command': 'orig'}", "b:{'command': 'x'}", "c:{'command': 'x'}"]
    assert folded.deny == "no"
    assert folded.arguments == {"command": "x"}  # no rewrite after a deny


# ----------------------------------------------------------- command hooks

@pytest.mark.sandbox
async def test_command_hooks_deny_replace_output_and_fail_closed(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    script = {"responses": [
        {"tool_calls": [{"name": "shell", "call_id": "c1",
                         "arguments": {"command": "echo real"}},
                        {"name": "shell", "call_id": "c2",
                         "arguments": {"command": "echo forbidden"}}]},
        {"text": "done"}]}
    farm = farm_pool.farm(procs, tmp_path, script, workers=2)
    hooks = [
        # JSON arrives on stdin: deny exactly the call whose input mentions "forbidden"
        {"event": "pre_tool", "timeout_s": 20,
         "command": "if grep -q forbidden; then echo '{\"deny\": \"blocked by script\"}'; fi"},
        {"event": "post_tool", "timeout_s": 20,
         "command": "grep -q '\"event\": \"post_tool\"' && echo '{\"output\": \"replaced\"}'"},
    ]
    async with engine(farm) as eng:
        sid = await eng.session(approval="allow", hooks=hooks)
        events = await eng.run_until(sid, {"type": "user_input", "text": "go"}, timeout_s=60)
        assert events[-1].type == "turn_complete", [(e.type, e.payload) for e in events]
        ends = {e.payload["call_id"]: e.payload for e in events if e.type == "tool_call_end"}
        assert ends["c1"]["output"] == "replaced"
        assert ends["c2"]["outcome"] == "deny"
        assert "blocked by script" in ends["c2"]["output"]


@pytest.mark.sandbox
async def test_command_hook_timeout_denies_and_crash_fails_the_turn(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    farm = farm_pool.farm(procs, tmp_path, ONE_CALL, workers=2)
    async with engine(farm) as eng:
        slow = await eng.session(approval="allow", hooks=[
            {"event": "pre_tool", "command": "sleep 30", "timeout_s": 1}])
        events = await eng.run_until(slow, {"type": "user_input", "text": "go"}, timeout_s=60)
        assert events[-1].type == "turn_complete"
        end = next(e for e in events if e.type == "tool_call_end")
        assert end.payload["outcome"] == "deny"  # fail closed
        crash = await eng.session(approval="allow", hooks=[
            {"event": "stop", "command": "exit 3", "timeout_s": 20}])
        events = await eng.run_until(crash, {"type": "user_input", "text": "go"}, timeout_s=60)
        assert events[-1].type == "turn_aborted"
        assert events[-1].payload["reason"] == "failed"
        execution = (await eng.store.executions_page(crash, limit=1)).items[0]
        assert execution.outcome == "failed"


class PushOnStartup(Middleware):
    name = "push_on_startup"

    async def session_start(self, inp: HookInput) -> HookResult | None:
        if inp.data["source"] == "startup":
            return HookResult(push_input="pushed by the session_start hook")
        return None


async def test_session_start_may_push_input(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    farm = farm_pool.farm(procs, tmp_path, {"responses": [{"text": "answered"}]}, services="model")
    async with engine(farm, middleware=lambda spec: [PushOnStartup()]) as eng:
        sid = await eng.session()
        events = await eng.run_until(sid, None, until=lambda e: e.type == "turn_complete")
        user = next(e for e in events if e.type == "user_message")
        assert user.payload["text"] == "pushed by the session_start hook"
        assert user.submission_id is None  # a system input
        assert events[-1].payload["last_agent_message"] == "answered"


@pytest.mark.sandbox
async def test_command_hook_rejects_a_prompt_that_is_then_never_persisted(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    farm = farm_pool.farm(procs, tmp_path, {"responses": [{"text": "ok"}]}, workers=1)
    hook = {"event": "user_prompt_submit", "timeout_s": 20,
            "command": "if grep -q secret; then echo '{\"reject\": \"no secrets\"}'; fi"}
    async with engine(farm) as eng:
        sid = await eng.session(hooks=[hook])
        rejected = await eng.run_until(sid, {"type": "user_input", "text": "my secret 42"})
        assert rejected[-1].type == "turn_aborted"
        assert rejected[-1].payload["reason"] == "rejected"
        assert "no secrets" in rejected[-1].payload["message"]
        loaded = await eng.store.load(sid)
        replay = await eng.store.replay_events(sid)
        assert loaded is not None
        assert "my secret 42" not in str((loaded.state.to_json(), loaded.context,
                                          [e.payload for e in replay]))
        accepted = await eng.run_until(sid, {"type": "user_input", "text": "fine text"},
                                       after_sequence=rejected[-1].sequence)
        assert accepted[-1].type == "turn_complete"


class PostToolExplodes(Middleware):
    name = "post_tool_explodes"

    async def post_tool(self, inp: HookInput) -> HookResult | None:
        raise RuntimeError("post-tool hook crashed")


@pytest.mark.sandbox
async def test_a_failing_post_tool_hook_in_a_parallel_round_fails_the_turn_cleanly(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    script = {"responses": [
        {"tool_calls": [{"name": "shell", "call_id": "fast", "arguments": {"command": "true"}},
                        {"name": "shell", "call_id": "slow",
                         "arguments": {"command": "sleep 20"}}]},
        {"text": "next turn works"}]}
    farm = farm_pool.farm(procs, tmp_path, script, workers=2)
    async with engine(farm, middleware=lambda spec: [PostToolExplodes()]) as eng:
        sid = await eng.session(approval="allow")
        events = await eng.run_until(sid, {"type": "user_input", "text": "go"}, timeout_s=15)
        assert events[-1].type == "turn_aborted"
        assert events[-1].payload["reason"] == "failed"
        error = next(e for e in events if e.type == "error")
        assert error.payload["kind"] == "hook_failed"
        saved = await eng.store.load(sid)
        assert saved is not None
        calls = sorted(i["call_id"] for i in saved.context if i.get("type") == "function_call")
        outs = sorted(i["call_id"] for i in saved.context
                      if i.get("type") == "function_call_output")
        assert calls == outs == ["fast", "slow"]  # the cancelled call was closed too
        assert saved.state.active_turn is None
        execution = (await eng.store.executions_page(sid, limit=1)).items[0]
        assert execution.outcome == "failed"
