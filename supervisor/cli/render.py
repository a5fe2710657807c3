"""Readable rendering of session events for the terminal.

Streamed text is written as it arrives; tool calls show a live line that is
closed with their outcome; approval requests are shown with the command to
answer them. Unknown event types are shown compactly rather than dropped.

Invariant: everything an event carries is untrusted (model text, tool output,
file names, arguments, error messages). It reaches the terminal only through
``clean``, which shows every control character visibly escaped (``\\x1b``,
``\\x07``, ``\\x9b``, ``\\u202e``...): no escape sequence from a tool or a
model can write the clipboard (OSC 52), set the title, move the cursor, erase
the screen or reorder text (bidi overrides), so none can hide or fake an
approval prompt. The only escape sequences written are the renderer's own
colours, added after cleaning. ``--json`` output does not come through here:
it is lossless (JSON escapes control characters itself).
"""

from __future__ import annotations

import json
import re
from typing import Any, TextIO

_MAX_SHOWN = 2000

# C0 controls except newline and tab, DEL, C1 controls, lone surrogates (they
# cannot be written as UTF-8), line/paragraph separators, and the invisible
# formatting characters that reorder or hide text: bidi embeddings, overrides
# and isolates, LRM/RLM/ALM, zero-width characters, word joiner, BOM.
_UNSAFE = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\u2028\u2029"
    "\u061c\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u2069\ufeff]")
_UNSAFE_LINE = re.compile(_UNSAFE.pattern[:-1] + "\n\t]")


def _escape(m: re.Match[str]) -> str:
    c = m.group()
    if c == "\n":
        return "\\n"
    if c == "\t":
        return "\\t"
    if c == "\r":
        return "\\r"
    n = ord(c)
    return f"\\x{n:02x}" if n <= 0xFF else f"\\u{n:04x}"


def clean(text: str, *, one_line: bool = False) -> str:
    """``text`` safe for a terminal: each control or invisible formatting character
    shown as its escape (``\\x1b``); newlines and tabs kept unless ``one_line``."""
    return (_UNSAFE_LINE if one_line else _UNSAFE).sub(_escape, text)


def _short(value: Any, limit: int = 160) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = clean(text, one_line=True)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _retry_reason(p: dict[str, Any]) -> str:
    """Why a model step is retried, from its diagnostics (the provider's error)."""
    diag = p.get("diagnostics") or {}
    retry = diag.get("provider_retry") or {}
    error = diag.get("error") or {}
    kind = retry.get("kind") or error.get("kind") or p.get("reason") or "?"
    message = retry.get("message") or error.get("message") or ""
    attempt = retry.get("attempt") or p.get("attempt")
    delay = retry.get("delay_s")
    head = f"attempt {attempt}, " if attempt else ""
    tail = f"; next in {float(delay):.1f}s" if isinstance(delay, int | float) else ""
    return f"({head}{kind}) {message}{tail}"


def _hint(p: dict[str, Any]) -> str:
    """A next step for the failures a user can fix."""
    text = f"{p.get('kind', '')} {p.get('message', '')}".lower()
    if "base_url" in text:
        return ""  # the message says it already
    if "connect" in text or ("timeout" in text and "http" in text):
        return (" — check the route's base_url in corral.toml (corral show SESSION "
                "names the route) and that the model server is up")
    return ""


class Renderer:
    def __init__(self, out: TextIO, *, color: bool | None = None) -> None:
        self.out = out
        self.color = out.isatty() if color is None else color
        self._in_text = False
        self._streamed: dict[str, str] = {}  # call_id -> the tail of its streamed output

    def _c(self, code: str, text: str) -> str:
        """``text`` cleaned, then coloured (colour codes are the only escapes written)."""
        text = clean(text)
        return f"\x1b[{code}m{text}\x1b[0m" if self.color else text

    def _line(self, text: str) -> None:
        """Write a line made of ``_c``/``_short``/``clean`` parts (already safe)."""
        if self._in_text:
            self.out.write("\n")
            self._in_text = False
        self.out.write(text + "\n")
        self.out.flush()

    def _stream(self, text: str, code: str | None = None) -> None:
        self.out.write(self._c(code, text) if code else clean(text))
        self.out.flush()
        self._in_text = True

    def prompt(self, text: str) -> None:
        """A question to the operator, on a line of its own."""
        if self._in_text:
            self.out.write("\n")
            self._in_text = False
        self.out.write(self._c("1;35", text))
        self.out.flush()

    def render(self, event: dict[str, Any]) -> None:
        kind = str(event.get("type", "?"))
        p = event.get("payload", event)
        if not isinstance(p, dict):
            p = {"value": p}
        if kind == "agent_message_delta":
            self._stream(str(p.get("delta", p.get("text", ""))))
        elif kind == "agent_message":
            if not self._in_text:
                self._line(self._c("1", "assistant: ") +
                           clean(str(p.get("text", ""))[:_MAX_SHOWN]))
            else:
                self._line("")
        elif kind == "agent_reasoning_delta":
            pass
        elif kind == "turn_started":
            self._line(self._c("2", f"── turn {p.get('turn_id', '')} started"))
        elif kind == "user_message":
            self._line(self._c("1;34", "user: ") + _short(p.get("text", ""), _MAX_SHOWN))
        elif kind == "tool_call_begin":
            self._line(self._c("33", f"▶ {p.get('name', '?')} ") + _short(p.get("arguments")))
        elif kind == "tool_call_output_delta":
            data = str(p.get("data", p.get("text", "")))
            call = str(p.get("call_id", ""))
            self._streamed[call] = (self._streamed.get(call, "") + data)[-200:]
            self._stream(data, "2")
        elif kind == "tool_call_end":
            outcome = p.get("outcome", "ok")
            mark = "✓" if outcome == "ok" and not p.get("is_error") else "✗"
            tier = (p.get("isolation") or {}).get("tier", "")
            output = str(p.get("output", ""))
            streamed = self._streamed.pop(str(p.get("call_id", "")), None)
            if streamed is None:
                shown = _short(output)
            elif output.rstrip().endswith(streamed.rstrip()[-40:]):
                shown = ""  # all of it is on the screen already
            else:  # the result ends otherwise (a cut marker, an error): show its end
                shown = "… " + _short(output.rstrip().rsplit("\n", 1)[-1])
            self._line(self._c("33", f"{mark} {p.get('name', '')} {outcome}") +
                       clean(f" [sandbox {tier}]" if tier else "") +
                       (" " + shown if shown else ""))
        elif kind == "exec_approval_request":
            calls = ", ".join(f"{_short(c.get('name'), 60)}({_short(c.get('arguments'), 60)})"
                              for c in p.get("calls", []) if isinstance(c, dict))
            self._line(self._c("1;35", f"? approval {p.get('id')} needed: ") + calls)
        elif kind == "model_step_completed" and p.get("outcome") == "retrying":
            self._line(self._c("2", f"… model step retrying {_retry_reason(p)}"))
        elif kind == "warning":
            self._line(self._c("33", "warning: ") + clean(str(p.get("message", ""))))
        elif kind == "error":
            self._line(self._c("31", f"error ({p.get('kind')}): ") +
                       clean(str(p.get("message", ""))) + _hint(p))
        elif kind == "store_status":  # a notice, not content (docs/storage.md)
            if p.get("state") == "unavailable":
                self._line(self._c("33", "… the session store is unreachable: the turn is "
                                   f"paused (up to {p.get('deadline_in_s')}s)"))
            else:
                self._line(self._c("2", "… the session store is back after "
                                   f"{p.get('waited_s')}s: the turn goes on"))
        elif kind == "frontend_render":
            block = p.get("block", {})
            self._line(self._c("2", f"[{block.get('state')}] {block.get('title')}"))
        elif kind == "token_count":
            total = (p.get("total") or p.get("total_usage") or {}).get("total")
            if total is not None:
                self._line(self._c("2", f"tokens: {total} total"))
        elif kind == "turn_complete":
            self._line(self._c("32", "── turn complete"))
        elif kind == "turn_aborted":
            message = p.get("message")
            self._line(self._c("31", f"── turn aborted: {p.get('reason', '')}") +
                       (clean(f" ({message})") if message else "") + _hint(p))
        elif kind in ("model_step_started", "model_step_completed", "session_configured"):
            pass
        else:
            self._line(self._c("2", f"{kind}: {_short(p)}"))
