"""Readable rendering of session events for the terminal.

Streamed text is written as it arrives; tool calls show a live line that is
closed with their outcome; approval requests are shown with the command to
answer them. Unknown event types are shown compactly rather than dropped.
"""

from __future__ import annotations

import json
from typing import Any, TextIO

_MAX_SHOWN = 2000


def _short(value: Any, limit: int = 160) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 1] + "…"


class Renderer:
    def __init__(self, out: TextIO, *, color: bool | None = None) -> None:
        self.out = out
        self.color = out.isatty() if color is None else color
        self._in_text = False

    def _c(self, code: str, text: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.color else text

    def _line(self, text: str) -> None:
        if self._in_text:
            self.out.write("\n")
            self._in_text = False
        self.out.write(text + "\n")
        self.out.flush()

    def render(self, event: dict[str, Any]) -> None:
        kind = event.get("type", "?")
        p = event.get("payload", event)
        if kind == "agent_message_delta":
            self.out.write(str(p.get("delta", p.get("text", ""))))
            self.out.flush()
            self._in_text = True
        elif kind == "agent_message":
            if not self._in_text:
                self._line(self._c("1", "assistant: ") + str(p.get("text", ""))[:_MAX_SHOWN])
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
            self.out.write(self._c("2", str(p.get("data", p.get("text", "")))))
            self.out.flush()
            self._in_text = True
        elif kind == "tool_call_end":
            outcome = p.get("outcome", "ok")
            mark = "✓" if outcome == "ok" and not p.get("is_error") else "✗"
            tier = (p.get("isolation") or {}).get("tier", "")
            self._line(self._c("33", f"{mark} {p.get('name', '')} {outcome}") +
                       (f" [sandbox {tier}]" if tier else "") + " " + _short(p.get("output", "")))
        elif kind == "exec_approval_request":
            calls = ", ".join(f"{c.get('name')}({_short(c.get('arguments'), 60)})"
                              for c in p.get("calls", []))
            self._line(self._c("1;35", f"? approval {p.get('id')} needed: ") + calls)
        elif kind == "model_step_completed" and p.get("outcome") == "retrying":
            self._line(self._c("2", f"… model step retrying: {p.get('reason', '')}"))
        elif kind == "warning":
            self._line(self._c("33", "warning: ") + str(p.get("message", "")))
        elif kind == "error":
            self._line(self._c("31", f"error ({p.get('kind')}): ") + str(p.get("message", "")))
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
            self._line(self._c("31", f"── turn aborted: {p.get('reason', '')}") +
                       (f" ({p.get('message')})" if p.get("message") else ""))
        elif kind in ("model_step_started", "model_step_completed", "session_configured"):
            pass
        else:
            self._line(self._c("2", f"{kind}: {_short(p)}"))
