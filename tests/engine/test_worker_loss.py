"""Worker loss: a lost model call is retried on another worker (each retry a
model_step_completed(retrying)); so is a lost compaction call, under the same
rule and attempts (each retry a warning ``compaction_retry``); a lost tool call
is never re-run silently (outcome unknown, and the model is told); a missing
tool is an error output.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from supervisor.store.records import EventRecord, SessionId
from tests.engine.farm import Engine, engine, start_farm
from tests.helpers import Procs, kill_tree


async def _turn_losing_the_first_worker(eng: Engine, sid: SessionId, text: str, *,
                                        kill_at: str, services: str) -> list[EventRecord]:
    """The events of one user turn (``text``) of ``sid``, up to its terminal event.

    At the turn's first ``kill_at`` event the farm's first worker is SIGKILLed (once),
    then a replacement worker serving ``services`` is started; the broker queues the
    retried work until it registers. (Starting the replacement first let a slow start
    on a loaded machine outlast the whole stream, so nothing was in flight at the kill.)"""
    first = eng.farm.workers[0]
    it = eng.manager.subscribe(sid)
    sub = await eng.manager.submit(sid, {"type": "user_input", "text": text})
    events: list[EventRecord] = []
    killed = False
    async with asyncio.timeout(60):
        async for e in it:
            if e.submission_id != sub:
                continue
            events.append(e)
            if e.type == kill_at and not killed:
                killed = True
                kill_tree(first.pid, signal.SIGKILL)
                await asyncio.to_thread(eng.farm.add_worker, services)
            if e.type in ("turn_complete", "turn_aborted"):
                break
    await it.aclose()  # type: ignore[attr-defined]
    return events


@pytest.mark.timeout(90)
async def test_lost_model_call_is_retried_on_another_worker(procs: Procs,
                                                             tmp_path: Path) -> None:
    # a slow stream (about 2 s): the worker is killed in the middle of attempt 1;
    # attempt 2 streams the whole answer again on the new worker
    farm = start_farm(procs, tmp_path, {"responses": [{"text_tokens": 40,
                                                       "chunk_delay_s": 0.05}]},
                      services="model")
    async with engine(farm) as eng:
        sid = await eng.session()
        events = await _turn_losing_the_first_worker(eng, sid, "hi",
                                                     kill_at="agent_message_delta",
                                                     services="model")
        assert events[-1].type == "turn_complete", [(e.type, e.payload) for e in events]
        outcomes = [e.payload["outcome"] for e in events if e.type == "model_step_completed"]
        assert outcomes == ["retrying", "completed"]
        retry = next(e for e in events if e.type == "model_step_completed")
        assert retry.payload["diagnostics"]["error"]["kind"] == "worker_lost"
        texts = [e.payload["text"] for e in events if e.type == "agent_message"]
        assert texts == ["".join(f"tok{i} " for i in range(40))]  # no partial of attempt 1
        execution = (await eng.store.executions_page(sid, limit=1)).items[0]
        assert (execution.outcome, execution.model_calls) == ("completed", 1)


@pytest.mark.sandbox
@pytest.mark.timeout(90)
async def test_lost_tool_call_is_unknown_and_never_rerun(procs: Procs, tmp_path: Path) -> None:
    command = "echo run | tee -a runs.txt; sleep 60"
    script = {"responses": [{"tool_calls": [{"name": "shell", "call_id": "effect",
                                             "arguments": {"command": command}}]},
                            {"text": "noted"}]}
    farm = start_farm(procs, tmp_path, script, services="tool,model")
    async with engine(farm) as eng:
        sid = await eng.session(approval="allow")
        events = await _turn_losing_the_first_worker(eng, sid, "do it",
                                                     kill_at="tool_call_output_delta",
                                                     services="tool,model")
        assert events[-1].type == "turn_complete", [(e.type, e.payload) for e in events]
        begins = [e for e in events if e.type == "tool_call_begin"]
        assert len(begins) == 1  # never re-dispatched
        end = next(e for e in events if e.type == "tool_call_end")
        assert end.payload["outcome"] == "unknown"
        assert end.payload["state"] == "unknown"
        saved = await eng.store.load(sid)
        assert saved is not None
        output = next(i for i in saved.context if i.get("type") == "function_call_output")
        assert "lost" in output["output"]
        assert "unknown" in output["output"]
        runs = (eng.farm.ws / "runs.txt").read_text()
        assert runs.count("run") == 1
        execution = (await eng.store.executions_page(sid, limit=1)).items[0]
        assert (execution.tool_calls, execution.failed_tool_calls) == (1, 1)


async def test_missing_tool_gets_an_error_output(procs: Procs, tmp_path: Path) -> None:
    script = {"responses": [{"tool_calls": [{"name": "teleport", "call_id": "c1",
                                             "arguments": {}}]}, {"text": "ok"}]}
    farm = start_farm(procs, tmp_path, script, services="model")
    async with engine(farm) as eng:
        sid = await eng.session(approval="allow")
        events = await eng.run_until(sid, {"type": "user_input", "text": "go"})
        assert events[-1].type == "turn_complete"
        end = next(e for e in events if e.type == "tool_call_end")
        assert end.payload["is_error"] is True
        assert end.payload["outcome"] == "missing"
        assert "unknown tool 'teleport'" in end.payload["output"]
        assert "tool_call_begin" not in [e.type for e in events]


async def test_a_provider_retry_in_the_worker_shows_as_retrying(procs: Procs,
                                                                tmp_path: Path) -> None:
    farm = start_farm(procs, tmp_path, {"responses": [{"status": 500, "times": 1,
                                                       "text": "second try"}]},
                      services="model")
    routes = {"main": farm.route("main", max_retries=2)}
    async with engine(farm, routes=routes) as eng:
        sid = await eng.session()
        events = await eng.run_until(sid, {"type": "user_input", "text": "hi"})
        assert events[-1].type == "turn_complete"
        steps = [e.payload for e in events if e.type == "model_step_completed"]
        assert [p["outcome"] for p in steps] == ["retrying", "completed"]
        assert steps[0]["diagnostics"]["provider_retry"]["kind"] == "server_error"
        assert [e.payload["text"] for e in events if e.type == "agent_message"] == ["second try"]


async def test_retryable_failures_are_bounded(procs: Procs, tmp_path: Path) -> None:
    farm = start_farm(procs, tmp_path, {"responses": [{"status": 503}]}, services="model")
    async with engine(farm, model_attempts=3, model_retry_delay_s=0.01) as eng:
        sid = await eng.session()
        events = await eng.run_until(sid, {"type": "user_input", "text": "hi"})
        assert events[-1].type == "turn_aborted"
        assert events[-1].payload["reason"] == "failed"
        steps = [e.payload["outcome"] for e in events if e.type == "model_step_completed"]
        assert steps == ["retrying", "retrying", "failed"]
        assert [e.payload["attempt"] for e in events if e.type == "model_step_started"] == [
            1, 2, 3]
        execution = (await eng.store.executions_page(sid, limit=1)).items[0]
        assert (execution.outcome, execution.model_calls) == ("failed", 1)


@pytest.mark.timeout(90)
async def test_a_compaction_whose_worker_is_lost_is_retried(procs: Procs,
                                                            tmp_path: Path) -> None:
    # the compaction call takes 2 s at the provider; the worker running it is
    # SIGKILLed as soon as the notice is pending, and a new worker takes the retry
    farm = start_farm(procs, tmp_path, {"responses": [{"text": "done"}],
                                        "compact": {"usage": {"input": 5, "output": 3},
                                                    "delay_s": 2.0}},
                      services="model")
    async with engine(farm, compaction_threshold_tokens=1) as eng:
        sid = await eng.session()
        events = await _turn_losing_the_first_worker(eng, sid, "compact this",
                                                     kill_at="frontend_render",
                                                     services="model")
        assert events[-1].type == "turn_complete", [(e.type, e.payload) for e in events]
        retries = [e.payload["compaction_retry"] for e in events
                   if e.type == "warning" and "compaction_retry" in e.payload]
        assert [(r["attempt"], r["error"]["kind"]) for r in retries] == [(1, "worker_lost")]
        blocks = [e.payload["block"] for e in events if e.type == "frontend_render"]
        assert [(b["state"], b["title"]) for b in blocks] == [
            ("pending", "Context compacting"), ("complete", "Context compacted")]
        assert len({b["id"] for b in blocks}) == 1
        assert [e.type for e in events].count("context_compacted") == 1
        saved = await eng.store.load(sid)
        assert saved is not None
        assert (saved.state.compaction_count, saved.state.context_epoch) == (1, 1)


async def test_retryable_compaction_failures_are_bounded(procs: Procs,
                                                         tmp_path: Path) -> None:
    farm = start_farm(procs, tmp_path, {"responses": [{"text": "done"}],
                                        "compact": {"status": 503}}, services="model")
    async with engine(farm, compaction_threshold_tokens=1, model_attempts=3,
                      model_retry_delay_s=0.01) as eng:
        sid = await eng.session()
        events = await eng.run_until(sid, {"type": "user_input", "text": "compact this"})
        assert events[-1].type == "turn_aborted", [(e.type, e.payload) for e in events]
        assert events[-1].payload["reason"] == "failed"
        retries = [e.payload["compaction_retry"]["attempt"] for e in events
                   if e.type == "warning" and "compaction_retry" in e.payload]
        assert retries == [1, 2]
        assert farm.compactions() == 3  # model_attempts, as for a model call
        assert farm.model_responses() == 0
        blocks = [e.payload["block"] for e in events if e.type == "frontend_render"]
        assert blocks[-1]["title"] == "Context compaction failed"
        saved = await eng.store.load(sid)
        assert saved is not None
        assert saved.state.compaction_count == 0
