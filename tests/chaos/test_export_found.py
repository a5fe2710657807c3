"""Regressions found by chaos runs, kept as tests.

``export_compacted_mid_turn.json`` is a checkpoint exported by a 600 s
``corral chaos`` run (seed 42): a native compaction inside the turn folded
tool rounds 1 and 2 into the compaction item, and ``verify`` used to reject
the file ("call 'call_480_0' has no function_call_output").
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from supervisor.export import verify

DATA = Path(__file__).parent / "data"


def load() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((DATA / "export_compacted_mid_turn.json").read_text())
    return doc


def test_a_checkpoint_after_a_mid_turn_compaction_verifies() -> None:
    doc = load()
    messages = doc["content"]["logical_resume"]["messages"]
    assert any(m.get("type") == "compaction" for m in messages)
    assert verify(doc) == []


def test_a_call_still_in_the_context_must_have_its_output() -> None:
    doc = copy.deepcopy(load())
    messages = doc["content"]["logical_resume"]["messages"]
    doc["content"]["logical_resume"]["messages"] = [
        m for m in messages if not (m.get("type") == "function_call_output"
                                    and m.get("call_id") == "call_482_0")]
    problems = verify(doc)
    assert any("call_482_0" in p and "function_call_output" in p for p in problems)
