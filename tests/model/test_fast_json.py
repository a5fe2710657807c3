"""The stream decoders' ``_loads`` answers exactly as ``json.loads`` does."""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox_worker.model.streams import _loads

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12)
SPACE = st.text(alphabet=" \t\n\r\x0b\x0c\u00a0\u2028", max_size=3)


def _outcome(fn: Any, text: str) -> tuple[str, Any]:
    try:
        return "ok", fn(text)
    except ValueError as exc:
        return "error", type(exc)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return bool(a == b)


@settings(max_examples=400, deadline=None)
@given(JSON, SPACE, SPACE, st.text(max_size=3) | st.just(""))
def test_fast_loads_matches_json_loads(value: Any, before: str, after: str, junk: str) -> None:
    for text in (json.dumps(value), before + json.dumps(value) + after,
                 json.dumps(value) + junk, json.dumps(value, separators=(",", ":"))):
        kind, got = _outcome(_loads, text)
        want_kind, want = _outcome(json.loads, text)
        assert kind == want_kind, text
        assert kind == "error" or _same(got, want), text


@given(st.text(max_size=20))
def test_fast_loads_matches_json_loads_on_any_text(text: str) -> None:
    assert _outcome(_loads, text)[0] == _outcome(json.loads, text)[0]
