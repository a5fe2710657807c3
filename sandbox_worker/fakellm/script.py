"""The scripted provider's script: loading, checking, and the selection rule.

A script is JSON: ``{"responses": [ENTRY, ...], "compact"?: ENTRY}``. An entry
is a model output (``text``, ``text_tokens``, ``reasoning``, ``tool_calls``,
``usage``, ``stop_reason``, ``chunk_delay_s``) optionally combined with
faults (``status``, ``retry_after_s``, ``error_message``, ``hang``,
``cut_after_bytes``, ``malformed``, ``delay_s``) limited by ``times``.

Selection is stateless: a request gets entry ``k``, where ``k`` is the number
of model outputs already in its input (``count_outputs``). A fault applies
while the request's attempt number (header ``x-corral-attempt``, default 1)
is ``<= times``; without ``times`` it applies to every attempt. After the
fault's attempts, the entry's output is served. ``delay_s`` applies to every
attempt. Compaction items made by this server carry the ``k`` they replaced.

Invariants:
- Entries are checked at load; a bad script fails to load with a message
  naming the entry and field, never at request time.
- ``count_outputs`` depends only on the request body.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

COMPACTION_PREFIX: Final = "fakellm:"
OUTPUT_FIELDS: Final = frozenset({"text", "text_tokens", "reasoning", "tool_calls", "usage",
                                  "stop_reason", "chunk_delay_s"})
FAULT_FIELDS: Final = frozenset({"status", "retry_after_s", "error_message", "hang",
                                 "cut_after_bytes", "malformed", "delay_s", "times"})
STOP_REASONS: Final = ("end_turn", "tool_calls", "max_tokens", "content_filter")
USAGE_KEYS: Final = ("input", "output", "cached_input", "cache_write_input", "reasoning_output")


class ScriptError(ValueError):
    """The script file is not a valid script."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON string
    call_id: str


@dataclass(frozen=True, slots=True)
class Entry:
    text: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    usage: dict[str, int] = field(default_factory=dict)
    stop_reason: str = ""
    chunk_delay_s: float = 0.0
    # faults
    status: int = 0
    retry_after_s: float | None = None
    error_message: str = ""
    hang: bool = False
    cut_after_bytes: int | None = None
    malformed: bool = False
    delay_s: float = 0.0
    times: int | None = None

    def faulty(self, attempt: int) -> bool:
        has_fault = bool(self.status or self.hang or self.malformed
                         or self.cut_after_bytes is not None)
        return has_fault and (self.times is None or attempt <= self.times)


@dataclass(frozen=True, slots=True)
class Script:
    responses: tuple[Entry, ...]
    compact: Entry = Entry()


def _num(value: Any, where: str, *, integer: bool = False) -> Any:
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if not ok or isinstance(value, bool) or value < 0:
        raise ScriptError(f"{where} must be a non-negative {'integer' if integer else 'number'}")
    return value


def _entry(raw: Any, where: str, k: int) -> Entry:
    if not isinstance(raw, dict):
        raise ScriptError(f"{where} must be an object")
    unknown = set(raw) - OUTPUT_FIELDS - FAULT_FIELDS
    if unknown:
        raise ScriptError(f"{where}: unknown field(s) {sorted(unknown)}")
    text = raw.get("text", "")
    if not isinstance(text, str):
        raise ScriptError(f"{where}.text must be a string")
    if "text_tokens" in raw:
        n = _num(raw["text_tokens"], f"{where}.text_tokens", integer=True)
        text += "".join(f"tok{i % 1000} " for i in range(n))
    reasoning = raw.get("reasoning", "")
    if not isinstance(reasoning, str):
        raise ScriptError(f"{where}.reasoning must be a string")
    calls: list[ToolCall] = []
    raw_calls = raw.get("tool_calls", [])
    if not isinstance(raw_calls, list):
        raise ScriptError(f"{where}.tool_calls must be a list")
    for i, call in enumerate(raw_calls):
        cw = f"{where}.tool_calls[{i}]"
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ScriptError(f"{cw} needs a name")
        args = call.get("arguments", {})
        if isinstance(args, dict):
            args = json.dumps(args, separators=(",", ":"))
        if not isinstance(args, str):
            raise ScriptError(f"{cw}.arguments must be an object or a JSON string")
        call_id = call.get("call_id") or f"call_{k}_{i}"
        calls.append(ToolCall(call["name"], args, str(call_id)))
    usage = raw.get("usage", {})
    if not isinstance(usage, dict) or set(usage) - set(USAGE_KEYS):
        raise ScriptError(f"{where}.usage keys must be among {USAGE_KEYS}")
    for key, value in usage.items():
        _num(value, f"{where}.usage.{key}", integer=True)
    stop = raw.get("stop_reason", "")
    if stop and stop not in STOP_REASONS:
        raise ScriptError(f"{where}.stop_reason must be one of {STOP_REASONS}")
    status = raw.get("status", 0)
    if status and (not isinstance(status, int) or not 400 <= status <= 599):
        raise ScriptError(f"{where}.status must be an HTTP error status (400-599)")
    return Entry(
        text=text, reasoning=reasoning, tool_calls=tuple(calls), usage=dict(usage),
        stop_reason=stop,
        chunk_delay_s=float(_num(raw.get("chunk_delay_s", 0), f"{where}.chunk_delay_s")),
        status=status,
        retry_after_s=None if raw.get("retry_after_s") is None
        else float(_num(raw["retry_after_s"], f"{where}.retry_after_s")),
        error_message=str(raw.get("error_message", "")),
        hang=raw.get("hang") is True,
        cut_after_bytes=None if raw.get("cut_after_bytes") is None
        else int(_num(raw["cut_after_bytes"], f"{where}.cut_after_bytes", integer=True)),
        malformed=raw.get("malformed") is True,
        delay_s=float(_num(raw.get("delay_s", 0), f"{where}.delay_s")),
        times=None if raw.get("times") is None
        else int(_num(raw["times"], f"{where}.times", integer=True)),
    )


def parse_script(data: Any) -> Script:
    if not isinstance(data, dict) or not isinstance(data.get("responses"), list):
        raise ScriptError('a script is an object with a "responses" list')
    entries = tuple(_entry(e, f"responses[{k}]", k) for k, e in enumerate(data["responses"]))
    compact = _entry(data["compact"], "compact", 0) if "compact" in data else Entry()
    return Script(entries, compact)


def load_script(path: Path) -> Script:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ScriptError(f"cannot read script {path}: {exc}") from exc
    return parse_script(data)


# --------------------------------------------------------------------------
# Selection: k = model outputs already in the request's input
# --------------------------------------------------------------------------


def compaction_token(k: int) -> str:
    return COMPACTION_PREFIX + base64.b64encode(json.dumps({"k": k}).encode()).decode()


def _compaction_k(item: dict[str, Any]) -> int:
    content = item.get("encrypted_content")
    if not isinstance(content, str) or not content.startswith(COMPACTION_PREFIX):
        return 0
    try:
        value = json.loads(base64.b64decode(content[len(COMPACTION_PREFIX):]))
    except ValueError:
        return 0
    k = value.get("k") if isinstance(value, dict) else None
    return k if isinstance(k, int) and k >= 0 else 0


def count_outputs(api: str, body: dict[str, Any]) -> int:
    """Model outputs in a request body of the given wire format.

    Responses: maximal runs of assistant messages, function calls and reasoning
    (one run = one output), plus the ``k`` carried by compaction items.
    Chat Completions and Anthropic: assistant messages.
    """
    if api == "responses":
        raw = body.get("input")
        items = raw if isinstance(raw, list) else []
        k, in_run = 0, False
        for item in items:
            if not isinstance(item, dict):
                continue
            kind = item.get("type", "message")
            is_output = kind in ("function_call", "reasoning") or (
                kind == "message" and item.get("role") == "assistant")
            if is_output and not in_run:
                k += 1
            in_run = is_output
            if kind == "compaction":
                k += _compaction_k(item)
        return k
    msgs = body.get("messages")
    return sum(1 for m in (msgs if isinstance(msgs, list) else [])
               if isinstance(m, dict) and m.get("role") == "assistant")
