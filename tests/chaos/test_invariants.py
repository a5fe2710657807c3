"""The marker invariants compare effects on disk with the model's requests."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

from supervisor.chaos.invariants import effects, no_orphans, repeated_requests


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


def test_no_orphans_sees_live_farm_pids_and_tool_processes_left_in_worker_cgroups(
        tmp_path: Path) -> None:
    gone = 2**22 + 7  # above pid_max's default: no such process
    left = tmp_path / "pids" / "corral" / f"worker-{gone}"
    left.mkdir(parents=True)
    (left / "cgroup.procs").write_text("4242\n4243\n")
    empty = tmp_path / "memory" / "corral" / f"worker-{gone}"
    empty.mkdir(parents=True)
    (empty / "cgroup.procs").write_text("")
    found = [v.detail for v in no_orphans({gone, os.getpid()}, str(tmp_path), grace_s=0.2)]
    assert len(found) == 3, found
    assert f"pid {os.getpid()}" in found[0]  # this process is alive: it "outlived the farm"
    assert [d.split()[2] for d in found[1:]] == ["4242", "4243"]
    assert all(f"of worker {gone}" in d for d in found[1:])
    assert no_orphans({gone}, str(tmp_path / "nothing")) == []
    # a process that leaves the cgroup within the grace is no orphan
    (left / "cgroup.procs").write_text("")
    assert no_orphans({gone}, str(tmp_path)) == []
