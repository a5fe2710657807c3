"""Interrupts: a hung tool, a hung model call, partial output, stale targets.

An interrupt must end the turn with turn_aborted(interrupted) within 1 s even
when the worker holding the request is hung: the engine sends CANCEL through
the broker and never waits on the worker.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from supervisor.engine import SessionManager
from supervisor.store.records import EventRecord, SessionId
from tests.engine.farm import FarmPool, engine, start_farm, types
from tests.helpers import Procs, eventually

# The farms' brokers and workers are shared by the module (conftest.py's
# ``farm_pool``), also under xdist (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("engine-interrupts")


async def interrupt_when(manager: SessionManager, sid: SessionId, op: dict[str, object],
                         when: str, before: Callable[[], None] | None = None,
                         ) -> tuple[list[EventRecord], float]:
    """Submit ``op``; at the first event of type ``when`` interrupt the turn; return the
    events and the seconds from the interrupt to the terminal event."""
    events: list[EventRecord] = []
    it = manager.subscribe(sid)
    sub = await manager.submit(sid, op)
    turn_id = None
    sent_at = None
    async with asyncio.timeout(30):
        async for e in it:
            if e.submission_id != sub:
                continue
            events.append(e)
            if e.type == "turn_started":
                turn_id = e.payload["turn_id"]
            if e.type == when and sent_at is None:
                if before is not None:
                    before()
                sent_at = time.monotonic()
                await manager.submit(sid, {"type": "interrupt", "turn_id": str(turn_id)})
            if e.type in ("turn_complete", "turn_aborted"):
                break
    await it.aclose()  # type: ignore[attr-defined]
    assert sent_at is not None
    elapsed = time.monotonic() - sent_at
    print(f"\ninterrupt at {when}: turn_aborted after {elapsed * 1000:.0f} ms")
    return events, elapsed


@pytest.mark.sandbox
async def test_interrupt_during_hung_tool_aborts_within_one_second(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    script = {"responses": [{"tool_calls": [{"name": "shell", "call_id": "hang",
                                             "arguments": {"command": "echo started; sleep 600"}}]},
                            {"text": "after"}]}
    farm = farm_pool.farm(procs, tmp_path, script)
    async with engine(farm) as eng:
        sid = await eng.session(approval="allow")
        events, elapsed = await interrupt_when(
            eng.manager, sid, {"type": "user_input", "text": "hang"}, "tool_call_output_delta")
        assert events[-1].type == "turn_aborted"
        assert events[-1].payload["reason"] == "interrupted"
        assert elapsed < 1.0
        saved = await eng.store.load(sid)
        assert saved is not None
        outputs = [i for i in saved.context if i.get("type") == "function_call_output"]
        assert [o["call_id"] for o in outputs] == ["hang"]  # the call is closed, not dangling
        assert saved.state.active_turn is None
        assert saved.state.pending_tool_calls == []
        # the session is still usable: the next turn runs (the model sees the closed call)
        done = await eng.run_until(sid, {"type": "user_input", "text": "again"})
        assert done[-1].type == "turn_complete"


@pytest.mark.sandbox
async def test_interrupt_with_a_frozen_worker_does_not_wait_for_it(procs: Procs,
                                                                   tmp_path: Path) -> None:
    script = {"responses": [{"tool_calls": [{"name": "shell", "call_id": "frozen",
                                             "arguments": {"command": "echo go; sleep 600"}}]},
                            {"text": "after"}]}
    farm = start_farm(procs, tmp_path, script)
    worker = farm.workers[0]
    async with engine(farm) as eng:
        sid = await eng.session(approval="allow")
        events, elapsed = await interrupt_when(
            eng.manager, sid, {"type": "user_input", "text": "hang"}, "tool_call_output_delta",
            before=lambda: os.kill(worker.pid, signal.SIGSTOP))  # the worker hangs
        assert events[-1].type == "turn_aborted"
        assert events[-1].payload["reason"] == "interrupted"
        assert elapsed < 1.0
        os.kill(worker.pid, signal.SIGCONT)


async def test_interrupt_during_hung_model_call_aborts_within_one_second(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    farm = farm_pool.farm(procs, tmp_path, {"responses": [{"hang": True, "times": 1},
                                                      {"text": "fine"}]}, services="model")
    async with engine(farm) as eng:
        sid = await eng.session()
        events, elapsed = await interrupt_when(
            eng.manager, sid, {"type": "user_input", "text": "hang"}, "model_step_started")
        assert events[-1].type == "turn_aborted"
        assert events[-1].payload["reason"] == "interrupted"
        assert elapsed < 1.0
        steps = [e.payload["outcome"] for e in events if e.type == "model_step_completed"]
        assert steps == ["interrupted"]
        execution = (await eng.store.executions_page(sid, limit=1)).items[0]
        assert execution.outcome == "aborted"
        # the CANCEL reached the provider: the hung request ends
        await eventually(lambda: asyncio.to_thread(
            lambda: farm.llm_get("/_corral/stats")["active"] == 0), timeout_s=10,
            what="the hung provider request to be cancelled")


async def test_interrupt_keeps_partial_output(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    farm = farm_pool.farm(procs, tmp_path, {"responses": [{"text_tokens": 400,
                                                       "chunk_delay_s": 0.02}]},
                      services="model")
    async with engine(farm) as eng:
        sid = await eng.session()
        events, elapsed = await interrupt_when(
            eng.manager, sid, {"type": "user_input", "text": "talk"}, "agent_message_delta")
        assert events[-1].payload["reason"] == "interrupted"
        assert elapsed < 1.0
        partial = [e for e in events if e.type == "agent_message"]
        assert len(partial) == 1
        assert partial[0].payload["partial"] is True
        assert partial[0].payload["text"].startswith("tok0")
        saved = await eng.store.load(sid)
        assert saved is not None
        last = saved.context[-1]
        assert last["role"] == "assistant"
        assert last["corral"]["partial"] is True


async def test_stale_and_idle_interrupts_are_warnings(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    farm = farm_pool.farm(procs, tmp_path, {"responses": [{"text": "slow", "delay_s": 1.0},
                                                      {"text": "x"}]}, services="model")
    async with engine(farm) as eng:
        sid = await eng.session()
        idle = await eng.run_until(sid, {"type": "interrupt", "turn_id": "turn_nope"},
                                   until=lambda e: e.type == "warning")
        assert idle[-1].payload["message"] == "no active turn to interrupt"
        it = eng.manager.subscribe(sid, after_sequence=idle[-1].sequence)
        await eng.manager.submit(sid, {"type": "user_input", "text": "go"})
        seen: list[EventRecord] = []
        async with asyncio.timeout(20):
            async for e in it:
                seen.append(e)
                if e.type == "model_step_started":
                    await eng.manager.submit(sid, {"type": "interrupt", "turn_id": "turn_old"})
                if e.type == "turn_complete":
                    break
        await it.aclose()  # type: ignore[attr-defined]
        warnings = [e.payload["message"] for e in seen if e.type == "warning"]
        assert warnings == ["interrupt targeted a stale turn"]
        assert "turn_aborted" not in types(seen)
