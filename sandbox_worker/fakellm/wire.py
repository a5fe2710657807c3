"""Rendering a script entry in each provider's wire format.

``stream_events`` gives the SSE events of a streamed reply (each a complete,
framed ``bytes``); ``json_reply`` the body of a non-streamed one;
``error_reply`` a provider-shaped error body. Formats follow the providers'
documented shapes: OpenAI Responses (``response.*`` events), OpenAI Chat
Completions (``chat.completion.chunk`` data lines and ``[DONE]``), Anthropic
Messages (``message_start`` ... ``message_stop``).

Invariants:
- Text and reasoning are split into word deltas, tool-call arguments into
  small fragments, so streaming is real and clients must reassemble.
- Ids are derived from ``k`` so the same request gets byte-identical replies.
- Usage defaults: ``input`` from the request size (chars / 4), ``output``
  from the number of deltas; script values override.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

from sandbox_worker.fakellm.script import Entry

ARG_FRAGMENT_CHARS: Final = 12
_WORDS = re.compile(r"\S+\s*|\s+")


def split_words(text: str) -> list[str]:
    return _WORDS.findall(text)


def _fragments(arguments: str) -> list[str]:
    return [arguments[i:i + ARG_FRAGMENT_CHARS]
            for i in range(0, len(arguments), ARG_FRAGMENT_CHARS)] or [""]


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def usage_of(entry: Entry, request_chars: int) -> dict[str, int]:
    u = entry.usage
    output = u.get("output", len(split_words(entry.text)) + len(split_words(entry.reasoning))
                   + sum(len(_fragments(c.arguments)) for c in entry.tool_calls))
    return {"input": u.get("input", max(1, request_chars // 4)), "output": output,
            "cached_input": u.get("cached_input", 0),
            "cache_write_input": u.get("cache_write_input", 0),
            "reasoning_output": u.get("reasoning_output", 0)}


def _stop(entry: Entry) -> str:
    if entry.stop_reason:
        return entry.stop_reason
    return "tool_calls" if entry.tool_calls else "end_turn"


def sse(event: str | None, data: Any) -> bytes:
    head = f"event: {event}\n" if event else ""
    body = data if isinstance(data, str) else _dumps(data)
    return f"{head}data: {body}\n\n".encode()


# --------------------------------------------------------------------------
# OpenAI Responses
# --------------------------------------------------------------------------


def _responses_usage(u: dict[str, int]) -> dict[str, Any]:
    return {"input_tokens": u["input"],
            "input_tokens_details": {"cached_tokens": u["cached_input"]},
            "output_tokens": u["output"],
            "output_tokens_details": {"reasoning_tokens": u["reasoning_output"]},
            "total_tokens": u["input"] + u["output"]}


def _responses_items(entry: Entry, k: int) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if entry.reasoning:
        items.append({"type": "reasoning", "id": f"rs_{k}", "summary": [
            {"type": "summary_text", "text": entry.reasoning}]})
    if entry.text:
        items.append({"type": "message", "id": f"msg_{k}", "status": "completed",
                      "role": "assistant", "content": [
                          {"type": "output_text", "text": entry.text, "annotations": []}]})
    for i, call in enumerate(entry.tool_calls):
        items.append({"type": "function_call", "id": f"fc_{k}_{i}", "status": "completed",
                      "call_id": call.call_id, "name": call.name, "arguments": call.arguments})
    return items


def _responses_envelope(entry: Entry, k: int, model: str, usage: dict[str, int] | None,
                        output: list[dict[str, Any]]) -> dict[str, Any]:
    incomplete = entry.stop_reason in ("max_tokens", "content_filter")
    return {"id": f"resp_{k}", "object": "response", "created_at": 1_700_000_000 + k,
            "status": ("incomplete" if incomplete else "completed") if usage else "in_progress",
            "incomplete_details": {"reason": "max_output_tokens"
                                   if entry.stop_reason == "max_tokens" else "content_filter"}
            if incomplete and usage else None,
            "model": model, "output": output,
            "usage": _responses_usage(usage) if usage else None}


def _responses_events(entry: Entry, k: int, model: str, u: dict[str, int]) -> list[bytes]:
    events: list[bytes] = []
    seq = 0

    def emit(etype: str, **fields: Any) -> None:
        nonlocal seq
        events.append(sse(etype, {"type": etype, "sequence_number": seq, **fields}))
        seq += 1

    emit("response.created", response=_responses_envelope(entry, k, model, None, []))
    items = _responses_items(entry, k)
    for idx, item in enumerate(items):
        kind = item["type"]
        if kind == "reasoning":
            emit("response.output_item.added", output_index=idx,
                 item={"type": "reasoning", "id": item["id"], "summary": []})
            for word in split_words(entry.reasoning):
                emit("response.reasoning_summary_text.delta", item_id=item["id"],
                     output_index=idx, summary_index=0, delta=word)
            emit("response.reasoning_summary_text.done", item_id=item["id"], output_index=idx,
                 summary_index=0, text=entry.reasoning)
        elif kind == "message":
            emit("response.output_item.added", output_index=idx,
                 item={**item, "status": "in_progress", "content": []})
            emit("response.content_part.added", item_id=item["id"], output_index=idx,
                 content_index=0, part={"type": "output_text", "text": "", "annotations": []})
            for word in split_words(entry.text):
                emit("response.output_text.delta", item_id=item["id"], output_index=idx,
                     content_index=0, delta=word)
            emit("response.output_text.done", item_id=item["id"], output_index=idx,
                 content_index=0, text=entry.text)
            emit("response.content_part.done", item_id=item["id"], output_index=idx,
                 content_index=0, part=item["content"][0])
        else:
            emit("response.output_item.added", output_index=idx,
                 item={**item, "status": "in_progress", "arguments": ""})
            for frag in _fragments(item["arguments"]):
                emit("response.function_call_arguments.delta", item_id=item["id"],
                     output_index=idx, delta=frag)
            emit("response.function_call_arguments.done", item_id=item["id"],
                 output_index=idx, arguments=item["arguments"])
        emit("response.output_item.done", output_index=idx, item=item)
    final = _responses_envelope(entry, k, model, u, items)
    emit("response.incomplete" if final["status"] == "incomplete" else "response.completed",
         response=final)
    return events


# --------------------------------------------------------------------------
# OpenAI Chat Completions
# --------------------------------------------------------------------------

_CHAT_FINISH: Final = {"end_turn": "stop", "tool_calls": "tool_calls", "max_tokens": "length",
                       "content_filter": "content_filter"}


def _chat_usage(u: dict[str, int]) -> dict[str, Any]:
    return {"prompt_tokens": u["input"], "completion_tokens": u["output"],
            "total_tokens": u["input"] + u["output"],
            "prompt_tokens_details": {"cached_tokens": u["cached_input"]},
            "completion_tokens_details": {"reasoning_tokens": u["reasoning_output"]}}


def _chat_events(entry: Entry, k: int, model: str, u: dict[str, int]) -> list[bytes]:
    head = {"id": f"chatcmpl-{k}", "object": "chat.completion.chunk",
            "created": 1_700_000_000 + k, "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return sse(None, {**head, "choices": [{"index": 0, "delta": delta,
                                                "finish_reason": finish}]})

    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"reasoning_content": w}) for w in split_words(entry.reasoning)]
    events += [chunk({"content": w}) for w in split_words(entry.text)]
    for i, call in enumerate(entry.tool_calls):
        events.append(chunk({"tool_calls": [{"index": i, "id": call.call_id, "type": "function",
                                             "function": {"name": call.name, "arguments": ""}}]}))
        events += [chunk({"tool_calls": [{"index": i, "function": {"arguments": frag}}]})
                   for frag in _fragments(call.arguments)]
    events.append(chunk({}, _CHAT_FINISH[_stop(entry)]))
    events.append(sse(None, {**head, "choices": [], "usage": _chat_usage(u)}))
    events.append(sse(None, "[DONE]"))
    return events


def _chat_json(entry: Entry, k: int, model: str, u: dict[str, int]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": entry.text or None}
    if entry.reasoning:
        msg["reasoning_content"] = entry.reasoning
    if entry.tool_calls:
        msg["tool_calls"] = [{"id": c.call_id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}}
                             for c in entry.tool_calls]
    return {"id": f"chatcmpl-{k}", "object": "chat.completion", "created": 1_700_000_000 + k,
            "model": model, "choices": [{"index": 0, "message": msg,
                                         "finish_reason": _CHAT_FINISH[_stop(entry)]}],
            "usage": _chat_usage(u)}


# --------------------------------------------------------------------------
# Anthropic Messages
# --------------------------------------------------------------------------

_ANTHROPIC_STOP: Final = {"end_turn": "end_turn", "tool_calls": "tool_use",
                          "max_tokens": "max_tokens", "content_filter": "refusal"}
FAKE_SIGNATURE: Final = "fakellm-signature"


def _anthropic_usage(u: dict[str, int]) -> dict[str, int]:
    return {"input_tokens": max(0, u["input"] - u["cached_input"] - u["cache_write_input"]),
            "cache_creation_input_tokens": u["cache_write_input"],
            "cache_read_input_tokens": u["cached_input"], "output_tokens": u["output"]}


def _anthropic_blocks(entry: Entry) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if entry.reasoning:
        blocks.append({"type": "thinking", "thinking": entry.reasoning,
                       "signature": FAKE_SIGNATURE})
    if entry.text:
        blocks.append({"type": "text", "text": entry.text})
    for call in entry.tool_calls:
        blocks.append({"type": "tool_use", "id": call.call_id, "name": call.name,
                       "input": json.loads(call.arguments or "{}")})
    return blocks


def _anthropic_events(entry: Entry, k: int, model: str, u: dict[str, int]) -> list[bytes]:
    usage = _anthropic_usage(u)
    start_usage = {**usage, "output_tokens": 1}
    events = [sse("message_start", {"type": "message_start", "message": {
        "id": f"msg_{k}", "type": "message", "role": "assistant", "model": model,
        "content": [], "stop_reason": None, "stop_sequence": None, "usage": start_usage}})]
    events.append(sse("ping", {"type": "ping"}))
    for idx, block in enumerate(_anthropic_blocks(entry)):
        btype = block["type"]
        if btype == "thinking":
            start: dict[str, Any] = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [{"type": "thinking_delta", "thinking": w}
                      for w in split_words(entry.reasoning)]
            deltas.append({"type": "signature_delta", "signature": FAKE_SIGNATURE})
        elif btype == "text":
            start = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": w} for w in split_words(entry.text)]
        else:
            start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": frag}
                      for frag in _fragments(_dumps(block["input"]))]
        events.append(sse("content_block_start", {"type": "content_block_start", "index": idx,
                                                  "content_block": start}))
        events += [sse("content_block_delta", {"type": "content_block_delta", "index": idx,
                                               "delta": d}) for d in deltas]
        events.append(sse("content_block_stop", {"type": "content_block_stop", "index": idx}))
    events.append(sse("message_delta", {
        "type": "message_delta",
        "delta": {"stop_reason": _ANTHROPIC_STOP[_stop(entry)], "stop_sequence": None},
        "usage": {"output_tokens": usage["output_tokens"]}}))
    events.append(sse("message_stop", {"type": "message_stop"}))
    return events


def _anthropic_json(entry: Entry, k: int, model: str, u: dict[str, int]) -> dict[str, Any]:
    return {"id": f"msg_{k}", "type": "message", "role": "assistant", "model": model,
            "content": _anthropic_blocks(entry), "stop_reason": _ANTHROPIC_STOP[_stop(entry)],
            "stop_sequence": None, "usage": _anthropic_usage(u)}


# --------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------


def stream_events(api: str, entry: Entry, k: int, model: str, u: dict[str, int]) -> list[bytes]:
    if api == "responses":
        return _responses_events(entry, k, model, u)
    if api == "chat":
        return _chat_events(entry, k, model, u)
    return _anthropic_events(entry, k, model, u)


def json_reply(api: str, entry: Entry, k: int, model: str, u: dict[str, int]) -> dict[str, Any]:
    if api == "responses":
        items = _responses_items(entry, k)
        return _responses_envelope(entry, k, model, u, items)
    if api == "chat":
        return _chat_json(entry, k, model, u)
    return _anthropic_json(entry, k, model, u)


def compact_reply(body: dict[str, Any], token: str, k: int, model: str,
                  u: dict[str, int]) -> dict[str, Any]:
    """``/responses/compact``: user messages kept verbatim, then one compaction item."""
    raw = body.get("input")
    kept = [item for item in (raw if isinstance(raw, list) else [])
            if isinstance(item, dict) and item.get("type", "message") == "message"
            and item.get("role") == "user"]
    return {"id": f"cmp_{k}", "object": "response.compaction", "created_at": 1_700_000_000 + k,
            "model": model,
            "output": [*kept, {"type": "compaction", "id": f"cmp_item_{k}",
                               "encrypted_content": token}],
            "usage": _responses_usage(u)}


_ANTHROPIC_ERRORS: Final = {400: "invalid_request_error", 401: "authentication_error",
                            403: "permission_error", 404: "not_found_error",
                            413: "request_too_large", 429: "rate_limit_error",
                            529: "overloaded_error"}
_OPENAI_ERRORS: Final = {400: "invalid_request_error", 401: "invalid_api_key",
                         403: "permission_denied", 404: "not_found", 429: "rate_limit_exceeded"}


def error_reply(api: str, status: int, message: str) -> dict[str, Any]:
    if api == "anthropic":
        etype = _ANTHROPIC_ERRORS.get(status, "api_error")
        return {"type": "error", "error": {"type": etype, "message": message}}
    code = _OPENAI_ERRORS.get(status, "server_error")
    return {"error": {"message": message, "type": code, "param": None, "code": code}}
