"""Recovery is measured for the sessions a fault really affected."""

from __future__ import annotations

from typing import Any

from supervisor.chaos.recovery import FaultMark, affected, open_work, summarize


def ev(seq: int, type_: str, **payload: Any) -> dict[str, Any]:
    return {"sequence": seq, "type": type_, "payload": payload}


LOST = {"kind": "worker_lost", "message": "worker silent for 1.0s", "retryable": True}


def tool_turn(call: str) -> list[tuple[float, dict[str, Any]]]:
    return [(0.0, ev(1, "turn_started")), (0.1, ev(2, "model_step_started", step=1)),
            (0.2, ev(3, "model_step_completed", step=1, outcome="completed")),
            (0.3, ev(4, "tool_call_begin", call_id=call, name="shell"))]


def test_open_work_follows_the_events() -> None:
    live = tool_turn("c1")
    assert open_work(live, len(live)).tool_calls == {"c1"}
    assert open_work(live, 2).model_step == 1
    done = [*live, (0.5, ev(5, "tool_call_end", call_id="c1", outcome="ok")),
            (0.6, ev(6, "turn_complete"))]
    w = open_work(done, len(done))
    assert not w.turn_running
    assert not w.tool_calls
    assert w.model_step is None


def test_a_tool_kill_counts_only_the_session_whose_call_was_lost() -> None:
    hit = [*tool_turn("c1"),
           (11.0, {"sequence": 0, "type": "tool_call_output_delta", "payload": {}}),
           (11.2, ev(5, "tool_call_end", call_id="c1", outcome="unknown", error=LOST)),
           (11.7, ev(6, "model_step_started", step=2))]
    spared = [*tool_turn("c9"), (10.4, ev(5, "tool_call_end", call_id="c9", outcome="ok")),
              (10.5, ev(6, "model_step_started", step=2))]
    idle = [(0.0, ev(1, "session_configured"))]
    lives = {"a": hit, "b": spared, "c": idle}
    fault = FaultMark("worker", 10.0, "tool", {"a": 4, "b": 4, "c": 1})
    out = affected(fault, lives)
    assert list(out) == ["a"]
    assert out["a"] is not None
    assert abs(out["a"] - 1.7) < 1e-9


def test_a_supervisor_kill_counts_running_turns_and_reports_the_unrecovered() -> None:
    running = tool_turn("c1")
    lives = {"moving": [*running, (21.5, ev(5, "tool_call_end", call_id="c1", outcome="ok"))],
             "stuck": list(running), "idle": [(0.0, ev(1, "session_configured"))]}
    fault = FaultMark("supervisor", 20.0, None, {"moving": 4, "stuck": 4, "idle": 1})
    out = affected(fault, lives)
    assert set(out) == {"moving", "stuck"}
    assert out["moving"] is not None
    assert abs(out["moving"] - 1.5) < 1e-9
    assert out["stuck"] is None


def test_a_provider_kill_counts_steps_that_had_to_retry() -> None:
    open_step = [(0.0, ev(1, "turn_started")), (0.1, ev(2, "model_step_started", step=1))]
    retried = [*open_step, (5.2, ev(3, "model_step_completed", step=1, outcome="retrying")),
               (5.9, ev(4, "agent_message"))]
    finished = [*open_step, (5.1, ev(3, "model_step_completed", step=1, outcome="completed"))]
    fault = FaultMark("provider", 5.0, None, {"r": 2, "f": 2})
    out = affected(fault, {"r": retried, "f": finished})
    assert list(out) == ["r"]
    assert out["r"] is not None
    assert abs(out["r"] - 0.9) < 1e-9


def test_summary() -> None:
    assert summarize([]) == {"count": 0, "p50_s": None, "p99_s": None, "max_s": None}
    s = summarize([1.0, 2.0, 3.0, 10.0])
    assert s["count"] == 4
    assert s["p50_s"] == 2.5
    assert s["p99_s"] == 10.0
