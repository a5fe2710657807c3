"""Property tests: SSE parsing under any chunking, and Anthropic role alternation
and tool pairing for any conversation shape."""

from __future__ import annotations

import itertools
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox_worker.model.items import anthropic_body, chat_body, responses_body
from sandbox_worker.model.sse import SSEEvent, SSEParser

text = st.text(alphabet=st.characters(exclude_characters="\r\n", exclude_categories=["Cs"]),
               max_size=40)


@settings(max_examples=200, deadline=None)
@given(events=st.lists(st.tuples(st.sampled_from(["", "delta", "done"]),
                                 st.lists(text, min_size=1, max_size=3)), max_size=10),
       newline=st.sampled_from(["\n", "\r\n", "\r"]),
       cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=20))
def test_sse_round_trip_under_any_chunking(events: list[tuple[str, list[str]]], newline: str,
                                           cuts: list[int]) -> None:
    wire = ""
    for name, lines in events:
        if name:
            wire += f"event: {name}{newline}"
        wire += "".join(f"data: {line}{newline}" for line in lines) + newline
    raw = wire.encode()
    bounds = sorted({c % (len(raw) + 1) for c in cuts} | {0, len(raw)})
    parser = SSEParser()
    got: list[SSEEvent] = []
    for a, b in itertools.pairwise(bounds):
        got += parser.feed(raw[a:b])
    assert got == [SSEEvent(name or "message", "\n".join(lines)) for name, lines in events]


def _item(kind: int, i: int) -> dict[str, Any]:
    if kind == 0:
        return {"type": "message", "role": "user", "content": f"u{i}",
                "corral": {"cache_breakpoint": i % 3 == 0}}
    if kind == 1:
        return {"type": "message", "role": "assistant", "content": f"a{i}"}
    if kind == 2:
        return {"type": "function_call", "call_id": f"c{i}", "name": "shell",
                "arguments": json.dumps({"n": i})}
    if kind == 3:
        return {"type": "function_call_output", "call_id": f"c{i}", "output": f"o{i}"}
    return {"type": "message", "role": "developer", "content": f"d{i}"}


@settings(max_examples=300, deadline=None)
@given(kinds=st.lists(st.integers(min_value=0, max_value=4), max_size=30))
def test_anthropic_roles_alternate_and_nothing_is_lost(kinds: list[int]) -> None:
    items = [_item(k, i) for i, k in enumerate(kinds)]
    req: Any = {"op": "respond", "route": {"name": "m", "provider": "anthropic",
                                           "model": "m", "base_url": "http://x"},
                "instructions": "sys", "items": items, "tools": [], "stream": True,
                "session_id": "s"}
    body = anthropic_body(req, stream=True)
    msgs = body["messages"]
    roles = [m["role"] for m in msgs]
    assert all(a != b for a, b in itertools.pairwise(roles))
    blocks = [b for m in msgs for b in m["content"]]
    assert len(blocks) == len(items)
    assert sum("cache_control" in b for b in blocks) <= 2
    for m in msgs:
        types = [b["type"] for b in m["content"]]
        if m["role"] == "user":  # tool results lead their user turn
            n = types.count("tool_result")
            assert types[:n] == ["tool_result"] * n
    dumped = json.dumps(body) + json.dumps(chat_body(req, stream=True)) + json.dumps(
        responses_body(req, stream=True))
    assert '"corral"' not in dumped
