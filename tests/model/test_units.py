"""Pure parts of the model service and the scripted provider: SSE parsing,
route parsing, status mapping, the selection rule, script checking."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from sandbox_worker.api import ModelDelta, parse_route
from sandbox_worker.fakellm.script import (
    ScriptError,
    compaction_token,
    count_outputs,
    parse_script,
)
from sandbox_worker.model.errors import from_httpx, from_status, parse_retry_after
from sandbox_worker.model.http import read_stream
from sandbox_worker.model.sse import DEFAULT_MAX_EVENT_BYTES, SSEError, SSEEvent, SSEParser

STREAM = (b"event: a\r\ndata: {\"x\": 1}\r\n\r\n: keep-alive\n\ndata: line1\ndata: line2\n\n"
          b"data: \xc3\xa9t\xc3\xa9\n\nevent: b\rdata:no-space\r\r")
EXPECTED = [SSEEvent("a", '{"x": 1}'), SSEEvent("message", "line1\nline2"),
            SSEEvent("message", "été"), SSEEvent("b", "no-space")]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, len(STREAM)])
def test_sse_parser_any_chunking(size: int) -> None:
    parser = SSEParser()
    events: list[SSEEvent] = []
    for i in range(0, len(STREAM), size):
        events += parser.feed(STREAM[i:i + size])
    assert events == EXPECTED
    assert not parser.has_partial_event


def test_sse_parser_bounds_an_event() -> None:
    parser = SSEParser(max_event_bytes=100)
    parser.feed(b"data: " + b"x" * 30 + b"\n")
    with pytest.raises(SSEError):
        parser.feed((b"data: " + b"x" * 30 + b"\n") * 3)
    with pytest.raises(SSEError):
        SSEParser(max_event_bytes=100).feed(b"data: " + b"y" * 200)


def test_parse_route() -> None:
    r = parse_route("anthropic:claude-sonnet-4-5", None)
    assert r["base_url"] == "https://api.anthropic.com"
    assert r["provider"] == "anthropic"
    assert r["model"] == "claude-sonnet-4-5"
    r = parse_route("openai-chat:llama3", "http://127.0.0.1:8000/v1/", name="alt")
    assert r["base_url"] == "http://127.0.0.1:8000/v1"
    assert r["name"] == "alt"
    assert parse_route("openai-responses:gpt-5", None).get("native_compaction") is True
    s = parse_route("script:/tmp/s.json", None)
    assert s["script"] == "/tmp/s.json"
    assert s["provider"] == "openai-responses"
    assert s["base_url"] == ""
    s = parse_route("script:anthropic:/tmp/s.json", "http://127.0.0.1:1")
    assert s["provider"] == "anthropic"
    assert s["script"] == "/tmp/s.json"
    for bad in ("gpt-5", "openai:gpt-5", "anthropic:", "script:"):
        with pytest.raises(ValueError, match="route"):
            parse_route(bad, None)


@pytest.mark.parametrize(("status", "kind", "retryable"), [
    (400, "bad_request", False), (401, "auth", False), (403, "auth", False),
    (404, "bad_request", False), (422, "bad_request", False), (429, "rate_limited", True),
    (500, "server_error", True), (502, "server_error", True), (529, "server_error", True),
    (408, "timeout", True)])
def test_status_mapping(status: int, kind: str, retryable: bool) -> None:
    body = b'{"error": {"message": "short reason", "secret_field": "full body"}}'
    err = from_status(status, body, httpx.Headers({"retry-after": "3"}), "p m")
    assert err.kind == kind
    assert err.retryable is retryable
    assert "short reason" in err.message
    assert "full body" not in err.message
    if status == 429:
        assert err.retry_after_s == 3.0


def test_transport_errors_are_retryable_and_typed() -> None:
    assert from_httpx(httpx.ConnectError("x"), "p", streaming=False).kind == "connect_error"
    assert from_httpx(httpx.ReadTimeout("x"), "p", streaming=True).kind == "timeout"
    assert from_httpx(httpx.ConnectTimeout("x"), "p", streaming=False).kind == "timeout"
    err = from_httpx(httpx.RemoteProtocolError("x"), "p", streaming=True)
    assert err.kind == "stream_error"
    assert err.retryable
    # the message reaches clients: it says what happened, never a class name
    for exc in (httpx.ConnectError("x"), httpx.ReadTimeout("x"), httpx.PoolTimeout("x"),
                httpx.RemoteProtocolError("x"), httpx.ReadError("x"), httpx.ProxyError("x")):
        for streaming in (False, True):
            message = from_httpx(exc, "p", streaming=streaming).message
            assert type(exc).__name__ not in message, message
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") is None
    assert parse_retry_after("99999") == 600.0


def test_count_outputs_per_wire_format() -> None:
    responses = {"input": [
        {"type": "message", "role": "user", "content": "a"},
        {"type": "reasoning", "summary": []},
        {"type": "message", "role": "assistant", "content": []},
        {"type": "function_call", "call_id": "1"}, {"type": "function_call", "call_id": "2"},
        {"type": "function_call_output", "call_id": "1"},
        {"type": "function_call_output", "call_id": "2"},
        {"type": "function_call", "call_id": "3"},
        {"type": "function_call_output", "call_id": "3"},
        {"type": "message", "role": "assistant", "content": []}]}
    assert count_outputs("responses", responses) == 3
    compacted = {"input": [{"type": "message", "role": "user", "content": "a"},
                           {"type": "compaction", "encrypted_content": compaction_token(5)},
                           {"type": "function_call", "call_id": "9"}]}
    assert count_outputs("responses", compacted) == 6
    chat = {"messages": [{"role": "system"}, {"role": "user"}, {"role": "assistant"},
                         {"role": "tool"}, {"role": "assistant"}]}
    assert count_outputs("chat", chat) == 2
    assert count_outputs("anthropic", {"messages": [{"role": "user"},
                                                    {"role": "assistant"}]}) == 1
    assert count_outputs("anthropic", {"messages": "junk"}) == 0


def test_script_faults_and_checks() -> None:
    script = parse_script({"responses": [
        {"status": 429, "retry_after_s": 1, "times": 2, "text": "ok"},
        {"status": 500}, {"text_tokens": 3},
        {"tool_calls": [{"name": "shell", "arguments": {"command": "ls"}}]}]})
    first = script.responses[0]
    assert first.faulty(1)
    assert first.faulty(2)
    assert not first.faulty(3)
    assert script.responses[1].faulty(99)
    assert script.responses[2].text == "tok0 tok1 tok2 "
    assert script.responses[3].tool_calls[0].arguments == '{"command":"ls"}'
    assert script.responses[3].tool_calls[0].call_id == "call_3_0"
    bads: list[dict[str, Any]] = [
        {"responses": [{"txt": "typo"}]}, {"responses": [{"status": 200}]},
        {"responses": [{"usage": {"inputs": 1}}]}, {"responses": "x"},
        {"responses": [{"tool_calls": [{"arguments": {}}]}]}]
    for bad in bads:
        with pytest.raises(ScriptError):
            parse_script(bad)


def test_anthropic_decoder_ignores_unknown_blocks() -> None:
    from sandbox_worker.model.streams import AnthropicDecoder

    dec = AnthropicDecoder()
    events = [
        ("message_start", {"type": "message_start", "message": {"usage": {"input_tokens": 5}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {
            "type": "server_tool_use", "id": "s1", "name": "web_search", "input": {}}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {
            "type": "input_json_delta", "partial_json": "{\"q\":1}"}}),
        ("content_block_start", {"type": "content_block_start", "index": 1,
                                 "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 1,
                                 "delta": {"type": "text_delta", "text": "hi"}}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                           "usage": {"output_tokens": 3}}),
        ("message_stop", {"type": "message_stop"}),
    ]
    deltas = [d for name, data in events for d in dec.feed(SSEEvent(name, json.dumps(data)))]
    assert deltas == [{"type": "text_delta", "text": "hi"}]
    items, stop, usage = dec.finish()
    assert items == [{"type": "message", "role": "assistant",
                      "content": [{"type": "output_text", "text": "hi"}]}]
    assert stop == "end_turn"
    assert usage["total"] == 8


async def test_first_delta_leaves_before_the_rest_of_its_read_is_parsed() -> None:
    """One large read: the first text delta, then an event over the parser's
    bound. The first delta is relayed before the bad event is even parsed."""
    def event(obj: dict[str, Any]) -> bytes:
        return f"event: {obj['type']}\ndata: {json.dumps(obj)}\n\n".encode()

    read = b"".join([
        event({"type": "response.created", "response": {"id": "r"}}),
        event({"type": "response.output_item.added", "output_index": 0,
               "item": {"type": "message", "role": "assistant", "content": []}}),
        event({"type": "response.output_text.delta", "output_index": 0, "delta": "Hel"}),
        event({"type": "response.output_text.delta", "output_index": 0, "delta": "lo"}),
        b"data: " + b"x" * (DEFAULT_MAX_EVENT_BYTES + 1),
    ])

    async def reads() -> AsyncIterator[bytes]:
        yield read

    relayed: list[list[ModelDelta]] = []

    async def on_deltas(deltas: list[ModelDelta]) -> None:
        relayed.append(list(deltas))

    with pytest.raises(SSEError):
        await read_stream(reads(), "openai-responses", on_deltas)
    assert relayed == [[{"type": "text_delta", "text": "Hel"}]]


async def test_read_stream_relays_in_order_whatever_the_reads() -> None:
    """Any split of the stream into reads relays the same text, in order."""
    def event(obj: dict[str, Any]) -> bytes:
        return f"event: {obj['type']}\ndata: {json.dumps(obj)}\n\n".encode()

    words = [f"w{i} " for i in range(40)]
    stream = b"".join([
        event({"type": "response.output_item.added", "output_index": 0,
               "item": {"type": "message", "role": "assistant", "content": []}}),
        *(event({"type": "response.output_text.delta", "output_index": 0, "delta": w})
          for w in words),
        event({"type": "response.completed", "response": {"status": "completed"}}),
    ])
    for size in (1, 5, 64, 1000, len(stream)):
        async def reads(size: int = size) -> AsyncIterator[bytes]:
            for i in range(0, len(stream), size):
                yield stream[i:i + size]

        relayed: list[ModelDelta] = []

        async def on_deltas(deltas: list[ModelDelta], out: list[ModelDelta] = relayed) -> None:
            out.extend(deltas)

        items, _stop, _usage = await read_stream(reads(), "openai-responses", on_deltas)
        assert "".join(d.get("text", "") for d in relayed) == "".join(words)
        assert items[0]["content"][0]["text"] == "".join(words)
