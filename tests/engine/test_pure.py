"""Pure parts of the engine: lifecycles whose illegal moves raise, the event
envelope rule, hook result parsing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.engine import events as ev
from supervisor.engine.errors import IllegalTransition
from supervisor.engine.hooks import HookResult
from supervisor.engine.phases import CallState, TurnPhase, advance_call, advance_phase


def test_terminal_phases_and_states_have_no_way_out() -> None:
    for end in (TurnPhase.COMPLETED, TurnPhase.ABORTED, TurnPhase.FAILED):
        for target in TurnPhase:
            with pytest.raises(IllegalTransition):
                advance_phase(end, target)
    for done in (CallState.OK, CallState.FAILED, CallState.UNKNOWN):
        for target in CallState:
            with pytest.raises(IllegalTransition):
                advance_call(done, target)


def test_a_call_cannot_skip_dispatch_to_succeed() -> None:
    with pytest.raises(IllegalTransition):
        advance_call(CallState.REQUESTED, CallState.OK)
    with pytest.raises(IllegalTransition):
        advance_call(CallState.REQUESTED, CallState.STARTED)
    assert advance_call(CallState.STARTED, CallState.DISPATCHED) is CallState.DISPATCHED


@given(st.lists(st.sampled_from(list(CallState)), max_size=8))
def test_a_call_ends_at_most_once_whatever_is_tried(path: list[CallState]) -> None:
    state = CallState.REQUESTED
    endings = 0
    for target in path:
        try:
            state = advance_call(state, target)
        except IllegalTransition:
            continue
        endings += state.terminal
    assert endings <= 1


def test_durable_and_live_event_types_are_disjoint_and_enforced() -> None:
    assert not ev.DURABLE_TYPES & ev.LIVE_ONLY_TYPES
    with pytest.raises(ValueError, match="not a durable"):
        ev.durable("s", 1, ev.AGENT_MESSAGE_DELTA, {}, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a live-only"):
        ev.live("s", 1, 1, ev.TURN_COMPLETE, {}, None)  # type: ignore[arg-type]
    delta = ev.live("s", 7, 2, ev.AGENT_MESSAGE_DELTA, {"text": "x"}, None)  # type: ignore[arg-type]
    assert (delta.sequence, delta.payload["after_sequence"], delta.payload["delta_index"]) == (
        0, 7, 2)


@pytest.mark.parametrize("bad", [[], "deny", {"stop": 3}, {"append_items": [1]},
                                 {"request": "x"}, {"nonsense": True}])
def test_hook_results_from_programs_are_checked(bad: object) -> None:
    with pytest.raises(ValueError, match="hook result"):
        HookResult.from_json(bad)


def test_hook_result_decision_form() -> None:
    assert HookResult.from_json({"decision": "deny", "reason": "nope"}).deny == "nope"
    assert HookResult.from_json({"decision": "allow"}).allow is True
