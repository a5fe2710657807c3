"""The human renderer never writes a control sequence it did not make itself.

Property-tested: whatever text an event carries, in whatever field, the
renderer's output holds no control character, no lone surrogate and no
invisible reordering character except its own colour codes (``ESC [ N m``).
"""

from __future__ import annotations

import io
import re
import unicodedata
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.cli.render import Renderer, clean

OWN_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
BIDI_AND_INVISIBLE = set("\u061c\u200b\u200c\u200d\u200e\u200f\u202a\u202b\u202c\u202d\u202e"
                         "\u2060\u2061\u2062\u2063\u2064\u2066\u2067\u2068\u2069\ufeff")


def unsafe(text: str) -> list[str]:
    return [c for c in text if (unicodedata.category(c) in ("Cc", "Cs", "Zl", "Zp")
                                and c not in "\n\t") or c in BIDI_AND_INVISIBLE]


HOSTILE = ["\x1b]52;c;cHduZWQ=\x07", "\x1b]0;title\x07", "\x1b[2J\x1b[H", "\x1b[3A\x1b[2K",
           "\x9b2J", "\x9d0;t\x9c", "\u202eevil", "\r\x08\x7f", "\ud800", "\u2028", "\x00"]
text_st = st.one_of(st.text(), st.sampled_from(HOSTILE),
                    st.lists(st.sampled_from([*HOSTILE, "a", "\n", "é"]), max_size=8)
                    .map("".join))
EVENT_TYPES = ["agent_message_delta", "agent_message", "turn_started", "user_message",
               "tool_call_begin", "tool_call_output_delta", "tool_call_end",
               "exec_approval_request", "model_step_completed", "warning", "error",
               "frontend_render", "turn_aborted", "store_status", "something_new"]


@st.composite
def events(draw: Any) -> dict[str, Any]:
    t = draw(text_st)
    kind = draw(st.sampled_from([*EVENT_TYPES, t]))
    payload = {k: draw(text_st) for k in ("delta", "text", "turn_id", "name", "data",
                                           "output", "id", "reason", "message", "kind",
                                           "outcome", "call_id", "state",
                                           "deadline_in_s", "waited_s")}
    payload["arguments"] = {draw(text_st): draw(text_st)}
    payload["calls"] = [{"name": draw(text_st), "arguments": draw(text_st)}]
    payload["isolation"] = {"tier": draw(text_st)}
    payload["block"] = {"state": draw(text_st), "title": draw(text_st)}
    payload["diagnostics"] = {"provider_retry": {"kind": draw(text_st),
                                                 "message": draw(text_st)}}
    if draw(st.booleans()):
        payload["outcome"] = "retrying"
    if draw(st.booleans()):
        payload["state"] = "unavailable"
    return {"type": kind, "payload": payload}


@settings(max_examples=100, deadline=None)
@given(st.lists(events(), min_size=1, max_size=6), st.booleans())
def test_the_renderer_writes_only_its_own_escapes(evs: list[dict[str, Any]],
                                                  color: bool) -> None:
    out = io.StringIO()
    renderer = Renderer(out, color=color)
    for event in evs:
        renderer.render(event)
    renderer.prompt("approve? ")
    written = OWN_COLOUR.sub("", out.getvalue())
    assert unsafe(written) == []
    written.encode("utf-8")  # no lone surrogate left: always writable


@given(text_st)
def test_clean_escapes_visibly_and_keeps_the_rest(text: str) -> None:
    cleaned = clean(text)
    assert unsafe(cleaned) == []
    assert unsafe(clean(text, one_line=True)) == []
    assert "\n" not in clean(text, one_line=True)
    if not unsafe(text):
        assert cleaned == text  # ordinary text, newlines and tabs pass untouched


def test_the_escapes_are_the_ones_people_read() -> None:
    assert clean("\x1b]52;c;eA==\x07") == "\\x1b]52;c;eA==\\x07"
    assert clean("\x9b2J\u202e\ud800\r") == "\\x9b2J\\u202e\\ud800\\r"
    assert clean("a\tb\nc") == "a\tb\nc"
    assert clean("a\tb\nc", one_line=True) == "a\\tb\\nc"


def test_the_store_notices_are_shown_and_escaped() -> None:
    out = io.StringIO()
    renderer = Renderer(out, color=False)
    renderer.render({"type": "store_status", "sequence": 0,
                     "payload": {"state": "unavailable", "deadline_in_s": "\x1b]52;c;x\x07"}})
    renderer.render({"type": "store_status", "sequence": 0,
                     "payload": {"state": "available", "waited_s": 2.5}})
    text = out.getvalue()
    assert unsafe(text) == []
    assert "the turn is paused" in text
    assert "back after 2.5s" in text
