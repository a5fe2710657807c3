"""Native compaction (OpenAI Responses ``/responses/compact``) through broker and
worker, and the scripted provider started programmatically."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from broker.client import BrokerClient
from sandbox_worker.fakellm.launch import start_fake_llm
from sandbox_worker.fakellm.script import parse_script
from sandbox_worker.fakellm.server import FakeLLM
from tests.helpers import Procs
from tests.model.stack import Stacks, recorded, request, run_call, start_fake, stats

HISTORY = [
    {"type": "message", "role": "user", "content": "fix the bug"},
    {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "ok"},
    {"type": "message", "role": "assistant", "content": "fixed"},
    {"type": "message", "role": "user", "content": "now test it"},
    {"type": "message", "role": "assistant", "content": "tested"},
]


async def test_native_compaction_then_continue(
        procs: Procs, stacks: Stacks, tmp_path: Path) -> None:
    url = start_fake(procs, tmp_path, {
        "responses": [{"text": "r0"}, {"text": "r1"}, {"text": "r2"}, {"text": "after"}],
        "compact": {"usage": {"input": 900, "output": 60}}})
    stack = stacks.get()
    async with BrokerClient(stack.frontend) as client:
        out = await run_call(client, request("openai-responses", url, items=HISTORY,
                                             op="compact", native_compaction=True))
        assert out.error is None, out.error
        assert out.result is not None
        items = out.result["items"]
        assert [i["type"] for i in items] == ["message", "message", "compaction"]
        assert [i["role"] for i in items[:2]] == ["user", "user"]
        assert items[2]["encrypted_content"]
        assert out.result["usage"]["input"] == 900
        assert out.result["usage"]["output"] == 60
        # The session continues from the compacted window: the next answer is
        # entry 3, as if the history were still there.
        window = [*items, {"type": "message", "role": "user", "content": "next"}]
        nxt = await run_call(client, request("openai-responses", url, items=window))
        assert nxt.error is None, nxt.error
        assert nxt.text() == "after"
        refused = await run_call(client, request("anthropic", url, items=HISTORY,
                                                 op="compact", native_compaction=True))
    assert refused.error is not None
    assert refused.error.failure.kind == "bad_request"
    assert refused.error.failure.retryable is False
    assert stats(url)["by_path"] == {"/responses/compact": 1, "/responses": 1}
    assert recorded(url)[0]["body"]["input"][0] == {
        "type": "message", "role": "user",
        "content": [{"type": "input_text", "text": "fix the bug"}]}


def test_start_fake_llm_programmatically(tmp_path: Path) -> None:
    script = tmp_path / "s.json"
    script.write_text('{"responses": [{"text": "hi"}]}')
    fake = start_fake_llm(script, log_path=tmp_path / "fake.log")
    try:
        reply = httpx.post(f"{fake.url}/v1/chat/completions", timeout=10,
                           json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
        assert reply.status_code == 200
        assert reply.json()["choices"][0]["message"]["content"] == "hi"
    finally:
        fake.stop()
    assert fake.proc.returncode == 0


async def test_scripted_provider_serves_many_concurrent_streams() -> None:
    script = parse_script({"responses": [{"text_tokens": 200}]})
    async with FakeLLM(script) as fake, httpx.AsyncClient(
            limits=httpx.Limits(max_connections=300)) as client:

        async def one() -> int:
            body = {"model": "m", "stream": True,
                    "messages": [{"role": "user", "content": "go"}]}
            async with client.stream("POST", f"{fake.url}/v1/messages", json=body) as r:
                return sum([len(c) async for c in r.aiter_bytes()])

        sizes = await asyncio.gather(*(one() for _ in range(300)))
        assert len(set(sizes)) == 1
        assert sizes[0] > 200 * 50
        assert fake.stats()["by_status"] == {"200": 300}
