"""Neutral (Responses-style) items to each provider's request body.

The supervisor speaks one item form (see ``sandbox_worker.api``); this module
writes it out as an OpenAI Responses, OpenAI Chat Completions or Anthropic
Messages request body. Pure functions, no I/O.

Invariants:
- The ``corral`` metadata key never reaches a provider: every item is copied
  field by field into the provider's shape, never passed through.
- Anthropic messages strictly alternate roles: consecutive items of one role
  merge into one message (parallel ``tool_use`` blocks in one assistant turn,
  their ``tool_result`` blocks in one user turn, results first).
- Chat Completions: the function calls that follow an assistant message join
  its ``tool_calls``; each result is a ``role: tool`` message.
- Cache breakpoints (``item["corral"]["cache_breakpoint"]``) become Anthropic
  ``cache_control`` on the item's last block (the last two marks are kept, as
  the tools and system prefix take two of Anthropic's four); OpenAI caches by
  prefix automatically and gets ``prompt_cache_key`` instead.
- Input that cannot be expressed for a provider raises ``BadRequestError``.
"""

from __future__ import annotations

import json
from typing import Any, Final

from sandbox_worker.api import Item, ModelCallRequest, ToolSchema
from sandbox_worker.model.errors import BadRequestError

DEFAULT_ANTHROPIC_MAX_TOKENS: Final = 8192
ANTHROPIC_ITEM_BREAKPOINTS: Final = 2
SUMMARY_PREFIX: Final = "Summary of the conversation so far:\n"
EPHEMERAL: Final = {"type": "ephemeral"}

Part = tuple[str, str]  # ("text", text) | ("image_url", url) | ("image_file", file_id)


def _is_breakpoint(item: Item) -> bool:
    meta = item.get("corral")
    return isinstance(meta, dict) and meta.get("cache_breakpoint") is True


def _str_field(item: Item, key: str, *, required: bool = True) -> str:
    value = item.get(key)
    if isinstance(value, str):
        return value
    if value is None and not required:
        return ""
    raise BadRequestError(f"item of type {item.get('type')!r}: field {key!r} must be a string")


def _parts(item: Item) -> list[Part]:
    """The content of a message item as normalised parts."""
    content = item.get("content")
    if isinstance(content, str):
        return [("text", content)]
    if not isinstance(content, list):
        raise BadRequestError("message item: content must be a string or a list of parts")
    parts: list[Part] = []
    for part in content:
        if not isinstance(part, dict):
            raise BadRequestError("message item: each content part must be a map")
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            parts.append(("text", _str_field(part, "text")))
        elif kind == "input_image":
            if isinstance(part.get("image_url"), str):
                parts.append(("image_url", part["image_url"]))
            elif isinstance(part.get("file_id"), str):
                parts.append(("image_file", part["file_id"]))
            else:
                raise BadRequestError("input_image part needs image_url or file_id")
        else:
            raise BadRequestError(f"unsupported content part type {kind!r}")
    return parts


def _text_of(parts: list[Part]) -> str:
    return "".join(value for kind, value in parts if kind == "text")


def _role(item: Item) -> str:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise BadRequestError(f"message item: unsupported role {role!r}")
    return str(role)


def _item_type(item: Any) -> str:
    if not isinstance(item, dict):
        raise BadRequestError("every item must be a map")
    kind = item.get("type")
    if kind not in ("message", "function_call", "function_call_output", "reasoning",
                    "compaction"):
        raise BadRequestError(f"unsupported item type {kind!r}")
    return str(kind)


def cache_key(req: ModelCallRequest) -> str:
    return req.get("prompt_cache_key") or req["session_id"]


# --------------------------------------------------------------------------
# OpenAI Responses
# --------------------------------------------------------------------------


def _responses_input(items: list[Item]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for item in items:
        kind = _item_type(item)
        if kind == "message":
            role = _role(item)
            text_type = "output_text" if role == "assistant" else "input_text"
            content: list[dict[str, Any]] = []
            for pkind, value in _parts(item):
                if pkind == "text":
                    content.append({"type": text_type, "text": value})
                elif pkind == "image_url":
                    content.append({"type": "input_image", "image_url": value, "detail": "auto"})
                else:
                    content.append({"type": "input_image", "file_id": value, "detail": "auto"})
            out.append({"type": "message", "role": role, "content": content})
        elif kind == "function_call":
            out.append({"type": "function_call", "call_id": _str_field(item, "call_id"),
                        "name": _str_field(item, "name"),
                        "arguments": _str_field(item, "arguments")})
        elif kind == "function_call_output":
            out.append({"type": "function_call_output", "call_id": _str_field(item, "call_id"),
                        "output": _str_field(item, "output")})
        elif kind == "reasoning":
            # Without store, only reasoning that carries its encrypted content can go back.
            if isinstance(item.get("encrypted_content"), str):
                entry: dict[str, Any] = {
                    "type": "reasoning",
                    "summary": [{"type": "summary_text", "text": item.get("text") or ""}]
                    if item.get("text") else [],
                    "encrypted_content": item["encrypted_content"],
                }
                if isinstance(item.get("id"), str):
                    entry["id"] = item["id"]
                out.append(entry)
        else:  # compaction
            if isinstance(item.get("encrypted_content"), str):
                entry = {"type": "compaction", "encrypted_content": item["encrypted_content"]}
                if isinstance(item.get("id"), str):
                    entry["id"] = item["id"]
                out.append(entry)
            elif item.get("summary"):
                out.append({"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": SUMMARY_PREFIX + _str_field(item, "summary")}]})
    return out


def _responses_tools(tools: list[ToolSchema]) -> list[dict[str, Any]]:
    return [{"type": "function", "name": t["name"], "description": t.get("description", ""),
             "parameters": t["parameters"], "strict": False} for t in tools]


def responses_body(req: ModelCallRequest, *, stream: bool) -> dict[str, Any]:
    route = req["route"]
    body: dict[str, Any] = {"model": route["model"], "input": _responses_input(req["items"])}
    if req.get("instructions"):
        body["instructions"] = req["instructions"]
    if req["tools"]:
        body["tools"] = _responses_tools(req["tools"])
        body["tool_choice"] = "auto"
        body["parallel_tool_calls"] = True
    if "max_output_tokens" in route:
        body["max_output_tokens"] = route["max_output_tokens"]
    body["store"] = False
    body["stream"] = stream
    body["prompt_cache_key"] = cache_key(req)
    return body


def compact_body(req: ModelCallRequest) -> dict[str, Any]:
    """Body of ``POST {base_url}/responses/compact``."""
    body: dict[str, Any] = {"model": req["route"]["model"],
                            "input": _responses_input(req["items"])}
    if req.get("instructions"):
        body["instructions"] = req["instructions"]
    return body


# --------------------------------------------------------------------------
# OpenAI Chat Completions
# --------------------------------------------------------------------------


def _chat_user_content(parts: list[Part]) -> str | list[dict[str, Any]]:
    if all(kind == "text" for kind, _ in parts):
        return _text_of(parts)
    content: list[dict[str, Any]] = []
    for kind, value in parts:
        if kind == "text":
            content.append({"type": "text", "text": value})
        elif kind == "image_url":
            content.append({"type": "image_url", "image_url": {"url": value}})
        else:
            raise BadRequestError("openai-chat: images by file_id are not supported; use a URL")
    return content


def _chat_messages(instructions: str, items: list[Item]) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    if instructions:
        msgs.append({"role": "system", "content": instructions})
    for item in items:
        kind = _item_type(item)
        if kind == "message":
            role = _role(item)
            parts = _parts(item)
            if role == "assistant":
                msgs.append({"role": "assistant", "content": _text_of(parts)})
            elif role in ("system", "developer"):
                msgs.append({"role": "system", "content": _text_of(parts)})
            else:
                msgs.append({"role": "user", "content": _chat_user_content(parts)})
        elif kind == "function_call":
            call = {"id": _str_field(item, "call_id"), "type": "function",
                    "function": {"name": _str_field(item, "name"),
                                 "arguments": _str_field(item, "arguments")}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            msgs.append({"role": "tool", "tool_call_id": _str_field(item, "call_id"),
                         "content": _str_field(item, "output")})
        elif kind == "compaction" and item.get("summary"):
            msgs.append({"role": "user", "content": SUMMARY_PREFIX + _str_field(item, "summary")})
        # reasoning and opaque compaction items have no Chat Completions form.
    for msg in msgs:
        if msg["role"] == "assistant" and msg.get("tool_calls") and msg["content"] == "":
            msg["content"] = None
    return msgs


def chat_body(req: ModelCallRequest, *, stream: bool) -> dict[str, Any]:
    route = req["route"]
    body: dict[str, Any] = {"model": route["model"],
                            "messages": _chat_messages(req.get("instructions", ""), req["items"])}
    if req["tools"]:
        body["tools"] = [{"type": "function", "function": {
            "name": t["name"], "description": t.get("description", ""),
            "parameters": t["parameters"]}} for t in req["tools"]]
        body["tool_choice"] = "auto"
        body["parallel_tool_calls"] = True
    if "max_output_tokens" in route:
        body["max_tokens"] = route["max_output_tokens"]
    body["stream"] = stream
    if stream:
        body["stream_options"] = {"include_usage": True}
    body["prompt_cache_key"] = cache_key(req)
    return body


# --------------------------------------------------------------------------
# Anthropic Messages
# --------------------------------------------------------------------------


def _anthropic_image(kind: str, value: str) -> dict[str, Any]:
    if kind == "image_url":
        if value.startswith("data:"):
            header, _, data = value.partition(",")
            media = header[5:].split(";")[0] or "image/png"
            return {"type": "image", "source": {"type": "base64", "media_type": media,
                                                 "data": data}}
        return {"type": "image", "source": {"type": "url", "url": value}}
    return {"type": "image", "source": {"type": "file", "file_id": value}}


def _tool_input(arguments: str) -> dict[str, Any]:
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    if isinstance(value, dict):
        return value
    # The model once produced arguments that are not a JSON object; keep them visible.
    return {"arguments": arguments}


class _Turns:
    """Builds alternating-role Anthropic messages from blocks."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []

    def add(self, role: str, block: dict[str, Any]) -> dict[str, Any]:
        if self.messages and self.messages[-1]["role"] == role:
            self.messages[-1]["content"].append(block)
        else:
            self.messages.append({"role": role, "content": [block]})
        return block

    def finish(self) -> list[dict[str, Any]]:
        for msg in self.messages:
            if msg["role"] == "user":
                blocks = msg["content"]
                # Anthropic wants tool results first in a user turn.
                msg["content"] = ([b for b in blocks if b["type"] == "tool_result"]
                                  + [b for b in blocks if b["type"] != "tool_result"])
        return self.messages


def _anthropic_messages(items: list[Item]) -> list[dict[str, Any]]:
    turns = _Turns()
    marked: list[dict[str, Any]] = []
    for item in items:
        kind = _item_type(item)
        last: dict[str, Any] | None = None
        if kind == "message":
            role = _role(item)
            turn_role = "assistant" if role == "assistant" else "user"
            for pkind, value in _parts(item):
                if pkind == "text":
                    if not value:
                        continue  # Anthropic rejects empty text blocks
                    if role in ("system", "developer"):
                        value = f"<system>\n{value}\n</system>"
                    last = turns.add(turn_role, {"type": "text", "text": value})
                else:
                    if role == "assistant":
                        raise BadRequestError("anthropic: an assistant message cannot hold images")
                    last = turns.add("user", _anthropic_image(pkind, value))
        elif kind == "function_call":
            last = turns.add("assistant", {
                "type": "tool_use", "id": _str_field(item, "call_id"),
                "name": _str_field(item, "name"),
                "input": _tool_input(_str_field(item, "arguments"))})
        elif kind == "function_call_output":
            block: dict[str, Any] = {"type": "tool_result",
                                     "tool_use_id": _str_field(item, "call_id"),
                                     "content": _str_field(item, "output")}
            if item.get("is_error") is True:
                block["is_error"] = True
            last = turns.add("user", block)
        elif kind == "reasoning":
            if isinstance(item.get("signature"), str):
                last = turns.add("assistant", {"type": "thinking",
                                               "thinking": item.get("text") or "",
                                               "signature": item["signature"]})
            elif isinstance(item.get("redacted_data"), str):
                last = turns.add("assistant", {"type": "redacted_thinking",
                                               "data": item["redacted_data"]})
        elif item.get("summary"):  # compaction
            last = turns.add("user", {"type": "text",
                                      "text": SUMMARY_PREFIX + _str_field(item, "summary")})
        if last is not None and _is_breakpoint(item) and last["type"] not in (
                "thinking", "redacted_thinking"):
            marked.append(last)
    for block in marked[-ANTHROPIC_ITEM_BREAKPOINTS:]:
        block["cache_control"] = dict(EPHEMERAL)
    return turns.finish()


def anthropic_body(req: ModelCallRequest, *, stream: bool) -> dict[str, Any]:
    route = req["route"]
    body: dict[str, Any] = {
        "model": route["model"],
        "max_tokens": route.get("max_output_tokens", DEFAULT_ANTHROPIC_MAX_TOKENS),
    }
    if req.get("instructions"):
        # The stable prefix (tools, then system) is cached on every call.
        body["system"] = [{"type": "text", "text": req["instructions"],
                           "cache_control": dict(EPHEMERAL)}]
    body["messages"] = _anthropic_messages(req["items"])
    if req["tools"]:
        tools = [{"name": t["name"], "description": t.get("description", ""),
                  "input_schema": t["parameters"]} for t in req["tools"]]
        tools[-1]["cache_control"] = dict(EPHEMERAL)
        body["tools"] = tools
    body["stream"] = stream
    return body
