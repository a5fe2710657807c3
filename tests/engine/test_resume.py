"""Crash resume: a supervisor stopped mid-turn is replaced by a new one on the
same store, and every active turn continues from its durable state.

"Stopped" here is the engine's TaskGroup being cancelled (its process would be
killed): nothing is committed on the way out, so the new manager sees exactly
what the last committed step left.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from supervisor.engine import EngineNotRunning
from supervisor.store.records import EventRecord
from tests.engine.farm import engine, start_farm, types
from tests.helpers import PYTHON, Procs, eventually, kill_tree, read_line_with_deadline


async def run_to(eng_events: list[EventRecord], it: object, sub: str, stop_type: str) -> None:
    async with asyncio.timeout(20):
        async for e in it:  # type: ignore[attr-defined]
            if e.submission_id == sub:
                eng_events.append(e)
                if e.type == stop_type:
                    break
    await it.aclose()  # type: ignore[attr-defined]


async def test_resume_mid_model_call_reissues_the_step(procs: Procs, tmp_path: Path) -> None:
    farm = start_farm(procs, tmp_path, {"responses": [{"text_tokens": 30,
                                                       "chunk_delay_s": 0.05}]},
                      services="model")
    db = tmp_path / "resume.sqlite3"
    before: list[EventRecord] = []
    async with engine(farm, db=db) as eng:
        sid = await eng.session()
        it = eng.manager.subscribe(sid)
        sub = await eng.manager.submit(sid, {"type": "user_input", "text": "talk"})
        await run_to(before, it, sub, "agent_message_delta")
    async with engine(farm, db=db) as eng2:
        after = await eng2.run_until(
            sid, None, until=lambda e: e.type in ("turn_complete", "turn_aborted"),
            after_sequence=max(e.sequence for e in before))
        assert after[-1].type == "turn_complete"
        assert after[-1].submission_id == sub
        replay = await eng2.store.replay_events(sid)
        assert [e.sequence for e in replay] == list(range(1, len(replay) + 1))
        assert types(replay).count("model_step_started") == 2  # the step was re-issued
        assert types(replay).count("agent_message") == 1
        assert types(replay).count("turn_started") == 1
        execution = (await eng2.store.executions_page(sid, limit=1)).items[0]
        assert execution.outcome == "completed"


@pytest.mark.sandbox
async def test_resume_mid_tool_call_resolves_each_call_from_its_durable_state(
        procs: Procs, tmp_path: Path) -> None:
    script = {"responses": [
        {"tool_calls": [
            {"name": "shell", "call_id": "effect",
             "arguments": {"command": "echo run | tee -a runs.txt"}},
            {"name": "read_file", "call_id": "read", "arguments": {"path": "data.txt"}}]},
        {"text": "after restart"}]}
    # no tool worker yet: both calls sit dispatched at the broker when the supervisor stops
    farm = start_farm(procs, tmp_path, script, services="model")
    (farm.ws / "data.txt").write_text("payload\n")
    db = tmp_path / "resume.sqlite3"
    before: list[EventRecord] = []
    async with engine(farm, db=db) as eng:
        sid = await eng.session(approval="allow")
        it = eng.manager.subscribe(sid)
        sub = await eng.manager.submit(sid, {"type": "user_input", "text": "go"})
        await run_to(before, it, sub, "tool_call_begin")

        async def both_dispatched() -> bool:
            return sum(1 for p in eng.manager.sessions[sid].state.pending_tool_calls
                       if p["state"] == "dispatched") == 2
        await eventually(both_dispatched, timeout_s=10, what="both calls dispatched")
    saved_states = None
    await asyncio.to_thread(farm.add_worker, "tool")
    async with engine(farm, db=db) as eng2:
        loaded = await eng2.store.load(sid)
        assert loaded is not None
        saved_states = {p["call_id"]: p["state"] for p in loaded.state.pending_tool_calls}
        after = await eng2.run_until(
            sid, None, until=lambda e: e.type in ("turn_complete", "turn_aborted"),
            after_sequence=loaded.last_event_sequence)
        assert after[-1].type == "turn_complete", [(e.type, e.payload) for e in after]
        ends = {e.payload["call_id"]: e.payload for e in after if e.type == "tool_call_end"}
        assert ends["effect"]["outcome"] == "unknown"  # not idempotent: never re-run
        assert ends["read"]["outcome"] == "ok"  # idempotent: re-dispatched
        assert "payload" in ends["read"]["output"]
        begins = [e.payload for e in after if e.type == "tool_call_begin"]
        assert [(b["call_id"], b["attempt"]) for b in begins] == [("read", 2)]
        assert not (farm.ws / "runs.txt").exists()
    assert saved_states == {"effect": "dispatched", "read": "dispatched"}


async def test_an_idempotent_call_is_not_rerun_past_its_attempts_across_restarts(
        procs: Procs, tmp_path: Path) -> None:
    # No tool worker ever: the idempotent read sits dispatched at each stop. The
    # first restart re-dispatches it (attempt 2 of 2); the second finds its
    # attempts spent and ends it unknown (machine.reruns_lost), as a lost worker
    # would, instead of dispatching it once per restart without end.
    script = {"responses": [
        {"tool_calls": [{"name": "read_file", "call_id": "read",
                         "arguments": {"path": "data.txt"}}]},
        {"text": "after restarts"}]}
    farm = start_farm(procs, tmp_path, script, services="model")
    db = tmp_path / "resume.sqlite3"

    def read_dispatched(eng: Any, sid: str, attempt: int) -> Any:
        async def check() -> bool:
            return any(p["call_id"] == "read" and p["state"] == "dispatched"
                       and p["attempt"] == attempt
                       for p in eng.manager.sessions[sid].state.pending_tool_calls)
        return check

    async with engine(farm, db=db, idempotent_tool_attempts=2) as eng:
        sid = await eng.session(approval="allow")
        await eng.manager.submit(sid, {"type": "user_input", "text": "go"})
        await eventually(read_dispatched(eng, sid, 1), timeout_s=20, what="attempt 1")
    async with engine(farm, db=db, idempotent_tool_attempts=2) as eng:
        await eventually(read_dispatched(eng, sid, 2), timeout_s=20, what="attempt 2")
    async with engine(farm, db=db, idempotent_tool_attempts=2) as eng:
        # the whole journal (replay, then live): the third run may end the turn
        # before this subscribes
        events = await eng.run_until(
            sid, None, until=lambda e: e.type in ("turn_complete", "turn_aborted"))
        assert events[-1].type == "turn_complete", [(e.type, e.payload) for e in events]
        begins = [e.payload["attempt"] for e in events if e.type == "tool_call_begin"]
        assert begins == [1, 2]  # the first run and the first restart; none after
        end = next(e.payload for e in events if e.type == "tool_call_end")
        assert (end["call_id"], end["outcome"], end["attempt"]) == ("read", "unknown", 2)


@pytest.mark.sandbox
@pytest.mark.timeout(90)
async def test_supervisor_sigkilled_mid_tool_call_resumes_in_a_new_process(
        procs: Procs, tmp_path: Path) -> None:
    script = {"responses": [
        {"tool_calls": [{"name": "shell", "call_id": "effect",
                         "arguments": {"command": "echo run | tee -a runs.txt; sleep 3"}}]},
        {"text": "recovered"}]}
    farm = start_farm(procs, tmp_path, script)
    db = tmp_path / "killed.sqlite3"
    sup = procs.spawn([PYTHON, "-m", "tests.engine.engine_proc", "--db", str(db),
                       "--frontend", farm.frontend, "--llm-url", farm.llm_url,
                       "--workspace", str(farm.ws), "--text", "do it"],
                      name="engine", stdout=subprocess.PIPE)
    sid = json.loads(read_line_with_deadline(sup, 30))["session_id"]
    seen: list[str] = []
    while "tool_call_output_delta" not in seen:
        seen.append(json.loads(read_line_with_deadline(sup, 30))["type"])
    kill_tree(sup.pid, signal.SIGKILL)  # the supervisor dies mid tool call
    sup.wait(timeout=10)
    assert sup.stdout is not None
    sup.stdout.close()
    async with engine(farm, db=db) as eng:
        loaded = await eng.store.load(sid)
        assert loaded is not None
        assert loaded.state.active_turn is not None
        assert [p["state"] for p in loaded.state.pending_tool_calls] == ["started"]
        after = await eng.run_until(
            sid, None, until=lambda e: e.type in ("turn_complete", "turn_aborted"),
            after_sequence=loaded.last_event_sequence)
        assert after[-1].type == "turn_complete", [(e.type, e.payload) for e in after]
        end = next(e for e in after if e.type == "tool_call_end")
        assert end.payload["outcome"] == "unknown"
        assert after[-1].payload["last_agent_message"] == "recovered"
        replay = await eng.store.replay_events(sid)
        assert [e.sequence for e in replay] == list(range(1, len(replay) + 1))
    assert (farm.ws / "runs.txt").read_text().count("run") == 1


async def test_a_session_is_described_only_once_the_engine_has_resumed(
        procs: Procs, tmp_path: Path) -> None:
    farm = start_farm(procs, tmp_path, {"responses": [{"text": "hi"}]}, services="model")
    db = tmp_path / "describe.sqlite3"
    async with engine(farm, db=db) as eng:
        sid = await eng.session()
        await eng.run_until(sid, {"type": "user_input", "text": "hello"})
        last = (await eng.manager.describe(sid))["last_event_sequence"]
        assert last > 0
    # Not running (as while a restarted supervisor resumes its sessions): no
    # description from the record alone, which lacks the last event and made
    # `corral run --session` replay the whole session.
    with pytest.raises(EngineNotRunning):
        await eng.manager.describe(sid)
    async with engine(farm, db=db) as again:  # resumed: the same description
        assert (await again.manager.describe(sid))["last_event_sequence"] == last
