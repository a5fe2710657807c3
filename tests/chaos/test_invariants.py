"""The marker invariants compare effects on disk with the model's requests."""

from __future__ import annotations

from collections import Counter
from typing import Any

from supervisor.chaos.invariants import effects, repeated_requests


def begin(seq: int, k: int, call: str) -> dict[str, Any]:
    return {"sequence": seq, "type": "tool_call_begin", "payload": {
        "name": "shell", "call_id": call,
        "arguments": {"command": f"echo m-{k} >> effects.log && sleep 0.05"}}}


def end(seq: int, call: str, outcome: str) -> dict[str, Any]:
    return {"sequence": seq, "type": "tool_call_end",
            "payload": {"call_id": call, "outcome": outcome}}


def test_one_request_one_effect_is_clean() -> None:
    assert effects("s", [begin(1, 7, "c"), end(2, "c", "ok")], Counter({7: 1})) == []


def test_an_effect_twice_for_one_request_is_a_violation() -> None:
    found = effects("s", [begin(1, 7, "c"), end(2, "c", "ok")], Counter({7: 2}))
    assert [v.invariant for v in found] == ["effect_at_most_once"]
    assert "2 times for 1 request" in found[0].detail


def test_the_model_asking_twice_is_two_requests_not_a_violation() -> None:
    replay = [begin(1, 7, "c"), end(2, "c", "ok"), begin(3, 7, "c"), end(4, "c", "ok")]
    assert effects("s", replay, Counter({7: 2})) == []
    assert repeated_requests(replay) == 1


def test_an_effect_with_no_reported_end_and_an_ok_without_effect() -> None:
    lost = effects("s", [begin(1, 7, "c")], Counter({7: 1}))
    assert [v.invariant for v in lost] == ["unknown_reported"]
    missing = effects("s", [begin(1, 8, "d"), end(2, "d", "ok")], Counter())
    assert [v.invariant for v in missing] == ["effect_at_most_once"]
    unknown_ok = effects("s", [begin(1, 9, "e"), end(2, "e", "unknown")], Counter({9: 1}))
    assert unknown_ok == []
