"""Model calls through a real broker and worker, against the scripted provider,
for all three wire formats: streaming text, parallel tool calls, usage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from broker.client import BrokerClient
from tests.helpers import Procs
from tests.model.stack import PROVIDERS, Stacks, request, run_call, start_fake, stats

# One shared broker+worker stack per worker-option set (conftest.py's
# ``stacks``), also under xdist (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("model-streaming")

TEXT = "The quick brown fox jumps over the lazy dog, then streams home word by word."


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_text_streams_in_order_with_cached_usage(
        procs: Procs, stacks: Stacks, tmp_path: Path, provider: str) -> None:
    url = start_fake(procs, tmp_path, {"responses": [
        {"text": TEXT, "reasoning": "Let me think.", "chunk_delay_s": 0.01,
         "usage": {"input": 1200, "cached_input": 1000, "output": 20,
                   "reasoning_output": 4}}]})
    stack = stacks.get()
    async with BrokerClient(stack.frontend) as client:
        out = await run_call(client, request(provider, url))
    assert out.error is None, out.error
    assert out.result is not None
    texts = [p["text"] for p in out.partials if p["type"] == "text_delta"]
    assert "".join(texts) == TEXT
    assert len(texts) >= 3, "text was not streamed in several partials"
    reasoning = "".join(p["text"] for p in out.partials if p["type"] == "reasoning_delta")
    assert reasoning == "Let me think."
    kinds = [p["type"] for p in out.partials]
    assert kinds.index("reasoning_delta") < kinds.index("text_delta")
    items = out.result["items"]
    assert items[0]["type"] == "reasoning"
    assert items[0]["text"] == "Let me think."
    assert items[1] == {"type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": TEXT}]}
    assert out.result["stop_reason"] == "end_turn"
    assert out.result["provider"] == provider
    assert out.result["retries"] == 0
    usage = out.result["usage"]
    assert usage["input"] == 1200
    assert usage["cached_input"] == 1000
    assert usage["output"] == 20
    assert usage["total"] == 1220
    if provider != "anthropic":  # Anthropic does not report reasoning tokens apart
        assert usage["reasoning_output"] == 4
    assert stats(url)["by_k"] == {"0": 1}


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_parallel_tool_calls_stream_their_arguments(
        procs: Procs, stacks: Stacks, tmp_path: Path, provider: str) -> None:
    calls = [{"name": "shell", "arguments": {"command": "ls -la /workspace && echo done"}},
             {"name": "read_file", "arguments": {"path": "src/main.py", "limit": 200}}]
    url = start_fake(procs, tmp_path, {"responses": [
        {"text": "Running two tools.", "tool_calls": calls}]})
    stack = stacks.get()
    async with BrokerClient(stack.frontend) as client:
        out = await run_call(client, request(provider, url))
    assert out.error is None, out.error
    assert out.result is not None
    deltas = [p for p in out.partials if p["type"] == "tool_call_delta"]
    assert {d["index"] for d in deltas} == {0, 1}
    firsts = [d for d in deltas if "call_id" in d]
    assert [(d["index"], d["name"]) for d in firsts] == [(0, "shell"), (1, "read_file")]
    for i, call in enumerate(calls):
        args = "".join(d["arguments_delta"] for d in deltas if d["index"] == i)
        assert json.loads(args) == call["arguments"]
    fcs = [it for it in out.result["items"] if it["type"] == "function_call"]
    assert [f["name"] for f in fcs] == ["shell", "read_file"]
    assert [json.loads(f["arguments"]) for f in fcs] == [c["arguments"] for c in calls]
    assert fcs[0]["call_id"] != fcs[1]["call_id"]
    assert all(f["call_id"] for f in fcs)
    assert out.result["stop_reason"] == "tool_calls"


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_non_streaming_reply(
        procs: Procs, stacks: Stacks, tmp_path: Path, provider: str) -> None:
    url = start_fake(procs, tmp_path, {"responses": [
        {"text": "plain", "tool_calls": [{"name": "list_dir", "arguments": {"path": "."}}],
         "usage": {"input": 50, "cached_input": 20, "output": 5}}]})
    stack = stacks.get()
    async with BrokerClient(stack.frontend) as client:
        out = await run_call(client, request(provider, url, stream=False))
    assert out.error is None, out.error
    assert out.result is not None
    assert out.partials == []
    assert [i["type"] for i in out.result["items"]] == ["message", "function_call"]
    assert out.result["usage"]["cached_input"] == 20
    assert out.result["stop_reason"] == "tool_calls"
