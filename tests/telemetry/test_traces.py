"""OpenTelemetry traces from a real farm to a real OTLP/HTTP receiver (protobuf
decoded with opentelemetry-proto): parentage supervisor -> worker across the
processes, GenAI attributes, no content or keys by default, and a worker
SIGKILLed mid tool call ending the supervisor's span with worker_lost."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.client import SupervisorClient
from tests.helpers import eventually
from tests.telemetry.otlp_receiver import ReceivedSpan, Receiver, otlp_receiver
from tests.telemetry.test_metrics import run_turn

pytestmark = pytest.mark.timeout(180)

SECRET_ARG = "echo sekrit-argument-7"
SCRIPT = {"responses": [
    {"tool_calls": [{"name": "shell", "arguments": {"command": SECRET_ARG}}],
     "usage": {"input": 20, "output": 5}},
    {"text": "ran it", "usage": {"input": 30, "output": 6}},
    {"tool_calls": [{"name": "shell", "arguments": {"command": "sleep 30; echo late"}}]},
    {"text": "the worker was lost", "usage": {"input": 40, "output": 7}},
]}


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    with otlp_receiver() as rec:
        # The farm's children inherit the environment: the standard variables.
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rec.url)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        monkeypatch.setenv("CORRAL_API_KEY", "sk-test-never-in-a-span")
        yield rec


def _by_id(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    return {s.span_id: s for s in spans}


def _ancestors(span: ReceivedSpan, by_id: dict[str, ReceivedSpan]) -> list[ReceivedSpan]:
    out = []
    while span.parent_span_id and span.parent_span_id in by_id:
        span = by_id[span.parent_span_id]
        out.append(span)
    return out


async def test_traces_cross_the_processes_and_a_worker_kill(
        receiver: Receiver, telemetry_farm: Callable[..., Any], workspace_root: Path) -> None:
    # A command hook after each executed tool call (none runs for the lost one).
    farm = await telemetry_farm(SCRIPT, extra='[[hooks.post_tool]]\ncommand = "true"\n')
    ws = workspace_root / "ws"
    ws.mkdir()
    async with SupervisorClient(farm.endpoint) as sv:
        sid = await sv.create_session(workspace=str(ws))
        assert (await run_turn(sv, sid, "run echo"))["type"] == "turn_complete"

        async def turn_one_exported() -> bool:
            # Before the kill: a worker that served turn 1 may be the one killed,
            # and a killed worker's unexported spans are lost.
            spans = receiver.snapshot()
            return (sum(1 for s in spans if s.service == "corral-worker"
                        and s.name.startswith("chat ")) == 2
                    and any(s.name == "tool.run" for s in spans))

        await eventually(turn_one_exported, timeout_s=30, what="turn 1's worker spans")
        sub = await sv.submit(sid, {"type": "user_input", "text": "sleep"})
        victim = await eventually(lambda: _tool_worker_pid(sv), timeout_s=30,
                                  what="a worker to hold the tool call")
        os.kill(victim, signal.SIGKILL)
        async with asyncio.timeout(60):
            async for e in sv.events(sid):
                if e.get("submission_id") == sub and e["type"] in ("turn_complete",
                                                                     "turn_aborted"):
                    break

    async def two_turns() -> bool:
        spans = receiver.snapshot()
        return (sum(1 for s in spans if s.name == "turn") == 2
                and any(s.service == "corral-worker" and s.name == "tool.run"
                        for s in spans))

    await eventually(two_turns, timeout_s=30, what="both turns' spans exported")
    spans = receiver.snapshot()
    by_id = _by_id(spans)
    services = {s.service for s in spans}
    assert {"corral-supervisor", "corral-broker", "corral-worker"} <= services, services
    turns = sorted((s for s in spans if s.name == "turn"), key=lambda s: s.start_ns)
    assert all(t.parent_span_id == "" for t in turns)
    assert all(t.attributes["gen_ai.conversation.id"] == sid for t in turns)

    # Turn 1: turn -> chat (client) -> worker's model request -> chat (client).
    first, second = turns
    worker_chat = [s for s in spans if s.service == "corral-worker" and s.name.startswith("chat ")
                   and s.trace_id == first.trace_id]
    assert len(worker_chat) == 2, [s.name for s in spans]
    for s in worker_chat:
        # supervisor -> broker -> worker: the broker's span is the worker's parent.
        chain = [(a.service, a.name) for a in _ancestors(s, by_id)]
        assert chain == [("corral-worker", "model request"),
                         ("corral-broker", "broker dispatch"),
                         ("corral-supervisor", f"chat {s.attributes['gen_ai.request.model']}"),
                         ("corral-supervisor", "turn")], chain
        assert "gen_ai.server.time_to_first_token" in s.attributes
        assert s.attributes["gen_ai.operation.name"] == "chat"
    usage = {(s.attributes.get("gen_ai.usage.input_tokens"),
              s.attributes.get("gen_ai.usage.output_tokens")) for s in spans
             if s.service == "corral-supervisor" and s.name.startswith("chat ")
             and s.trace_id == first.trace_id}
    assert usage == {(20, 5), (30, 6)}
    run = next(s for s in spans if s.name == "tool.run" and s.trace_id == first.trace_id)
    chain = [(a.service, a.name) for a in _ancestors(run, by_id)]
    assert chain == [("corral-worker", "tool request"),
                     ("corral-broker", "broker dispatch"),
                     ("corral-supervisor", "execute_tool shell"),
                     ("corral-supervisor", "turn")], chain
    assert any(s.name == "sandbox.launch" and s.parent_span_id == run.parent_span_id
               for s in spans)
    execute = by_id[by_id[by_id[run.parent_span_id].parent_span_id].parent_span_id]
    assert execute.attributes["corral.outcome"] == "ok"
    assert execute.attributes["gen_ai.tool.name"] == "shell"
    assert execute.attributes["gen_ai.tool.call.id"]

    hooks = [s for s in spans if s.name == "hook post_tool"]
    assert [h.parent_span_id for h in hooks] == [first.span_id], hooks
    assert hooks[0].trace_id == first.trace_id
    assert hooks[0].status_code != 2

    # Turn 2: its tool call's worker was SIGKILLed; the supervisor's span of the
    # call ends with the failure kind, in the same turn's trace.
    lost = [s for s in spans if s.name == "execute_tool shell"
            and s.trace_id == second.trace_id]
    assert len(lost) == 1
    assert lost[0].attributes["error.type"] == "worker_lost"
    assert lost[0].status_code == 2  # STATUS_CODE_ERROR
    assert lost[0].parent_span_id == second.span_id

    # The broker's span of each request hangs under the supervisor's span of it.
    sup_chat = {s.span_id for s in spans if s.service == "corral-supervisor"
                and s.name.startswith("chat ") and s.trace_id == first.trace_id}
    dispatch = [s for s in spans if s.service == "corral-broker"
                and s.trace_id == first.trace_id]
    assert {s.name for s in dispatch} == {"broker dispatch"}
    assert {s.parent_span_id for s in dispatch
            if s.attributes["corral.service"] == "model"} == sup_chat
    assert execute.span_id in {s.parent_span_id for s in dispatch
                               if s.attributes["corral.service"] == "tool"}

    # No content, no key by default.
    for s in spans:
        for v in s.attributes.values():
            assert "sekrit-argument" not in str(v)
            assert "sk-test-never" not in str(v)


async def _tool_worker_pid(sv: SupervisorClient) -> int | None:
    status = await sv.status()
    for w in status["broker"]["workers"].get("tool", {}).get("workers", []):
        if "tool" in (w.get("in_flight_services") or []):
            return int(w["info"]["pid"])
    return None
