"""``supervisor.engine.bounds`` (pure): whatever the model or a hook produced,
what the engine commits is within the store's bounds and valid UTF-8, and the
wire never fails on a lone surrogate. Property-tested with Hypothesis.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.protocol import pack, unpack
from sandbox_worker.api import json_size
from supervisor.engine import HookInput, HookResult, Middleware, bounds
from supervisor.store.codec import Limits, encode_items
from tests.engine.farm import engine, start_farm
from tests.helpers import Procs

texts = st.text(alphabet=st.sampled_from(
    ["a", "\n", "\x00", '"', "\\", "é", "\U0001f600", "\ud800", "\udcff"]), max_size=3000)
values = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10) | texts,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(
        st.text(max_size=5), inner, max_size=5),
    max_leaves=12)


def _has_surrogate(value: object) -> bool:
    return any(0xD800 <= ord(c) <= 0xDFFF for c in json.dumps(value, ensure_ascii=False))


@given(values, st.integers(400, 5000))
@settings(max_examples=300, deadline=None)
def test_fit_value_bounds_and_cleans_without_touching_the_original(
        value: object, limit: int) -> None:
    before = copy.deepcopy(value)
    fitted = bounds.fit_value(value, limit)
    assert value == before  # never mutated
    assert not _has_surrogate(fitted)
    # Only strings are cut, down to their markers: a value of many strings may stay
    # above a small bound; the store then refuses it. Any single string fits.
    n_strings = json.dumps(fitted).count('"') // 2 + 1
    if limit > n_strings * (len(bounds.CUT_MARKER) + 64):
        assert json_size(fitted) <= limit
    if not _has_surrogate(value) and json_size(value) <= limit:
        assert fitted is value


@given(st.lists(st.builds(lambda t: {"type": "message", "role": "assistant",
                                      "content": [{"type": "output_text", "text": t}]},
                          texts), min_size=1, max_size=6), st.integers(2000, 6000))
@settings(max_examples=150, deadline=None)
def test_fit_items_meets_the_item_and_the_batch_bound(items: list[dict[str, object]],
                                                      item_limit: int) -> None:
    total = item_limit * 2
    fitted = bounds.fit_items(items, item_limit, total)  # type: ignore[arg-type]
    limits = Limits(max_item_bytes=item_limit, max_batch_bytes=total)
    encode_items(fitted, what="batch", limits=limits, total_limit=total)  # does not raise
    for item in fitted:
        assert json_size(item) <= item_limit


def test_a_huge_model_message_is_cut_with_the_marker() -> None:
    item = {"type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": '"' * 3_000_000}]}
    (fitted,) = bounds.fit_items([item], 1 << 20, 8 << 20)
    assert json_size(fitted) <= 1 << 20
    text = fitted["content"][0]["text"]
    assert text.startswith('"' * 1000)
    assert "cut by Corral to fit the store's bound" in text


@given(texts)
@settings(max_examples=200, deadline=None)
def test_the_wire_carries_any_string(text: str) -> None:
    got = unpack(pack({"k": [text, text.encode("utf-8", "surrogatepass")]}))
    assert got["k"][0] == bounds.scrub_surrogates(text)
    assert got["k"][1] == text.encode("utf-8", "surrogatepass")  # bytes stay bytes


def test_parse_arguments_refuses_what_the_store_cannot_hold() -> None:
    ok, problem, scrubbed = bounds.parse_arguments('{"path": "a\\ud800b", "n": 1.5}')
    assert ok == {"path": "a\ufffdb", "n": 1.5}
    assert problem is None
    assert scrubbed
    for raw, why in (('{"t": NaN}', "not a JSON number"), ('{"t": -Infinity}', "not a JSON"),
                     ('{"t": 1e999}', "out of range"), ("[" * 100_000 + "]" * 100_000,
                                                        "nested too deeply"),
                     ('["x"]', "must be a JSON object"), ("{", "not valid JSON"),
                     ("1" * 5000, "not valid JSON")):
        args, problem, _ = bounds.parse_arguments(raw)
        assert args is None
        assert problem is not None
        assert why in problem, (raw[:20], problem)


def test_clean_id_takes_only_short_valid_text() -> None:
    assert bounds.clean_id("call_1") == "call_1"
    for bad in ("", "x" * 257, "a\ud800", None, 7):
        assert bounds.clean_id(bad) is None


def test_a_call_approved_for_the_session_keeps_a_bounded_key() -> None:
    from supervisor.engine.approvals import call_key

    small = call_key("shell", {"command": "ls"})
    assert small == 'shell({"command": "ls"})'
    big = call_key("shell", {"command": "x" * 200_000})
    assert len(big) < 400
    assert big == call_key("shell", {"command": "x" * 200_000})  # still the exact call
    assert big != call_key("shell", {"command": "x" * 200_001})


class _Huge(Middleware):
    """Hooks that hand back more than the store holds, and lone surrogates."""

    async def pre_model(self, inp: HookInput) -> HookResult | None:
        if inp.data.get("step") == 1:
            return HookResult(context='"' * 3_000_000 + "\ud800")
        return None

    async def post_tool(self, inp: HookInput) -> HookResult | None:
        return HookResult(output="\x00" * 2_000_000, context="after \udcff")

    async def pre_tool(self, inp: HookInput) -> HookResult | None:
        return HookResult(deny="no " * 500_000) if inp.data["call_id"] == "denied" else None


@pytest.mark.sandbox
@pytest.mark.timeout(120)
async def test_huge_hook_output_is_stored_cut_and_the_turn_goes_on(
        procs: Procs, tmp_path: Path) -> None:
    script = {"responses": [
        {"tool_calls": [{"name": "shell", "call_id": "c1", "arguments": {"command": "echo"}},
                        {"name": "shell", "call_id": "denied",
                         "arguments": {"command": "echo"}}]},
        {"text": "done"}, {"text": "again"}]}
    farm = start_farm(procs, tmp_path, script)
    async with engine(farm, middleware=lambda spec: [_Huge()]) as eng:
        sid = await eng.session(approval="allow")
        events = await eng.run_until(sid, {"type": "user_input", "text": "go"})
        assert events[-1].type == "turn_complete", [(e.type, e.payload) for e in events][-3:]
        again = await eng.run_until(sid, {"type": "user_input", "text": "next"})
        assert again[-1].type == "turn_complete"
        loaded = await eng.store.load(sid)
        assert loaded is not None
        limit = eng.store.limits.max_item_bytes
        for item in loaded.context:
            assert json_size(item) <= limit
            assert not _has_surrogate(item)
        outputs = {i["call_id"]: i["output"] for i in loaded.context
                   if i["type"] == "function_call_output"}
        assert "cut by Corral to fit the store's bound" in outputs["c1"]
        assert len(outputs["denied"]) < 5000
        hook_items = [json.dumps(i, ensure_ascii=False) for i in loaded.context
                      if i.get("corral")]
        assert any("cut by Corral" in t for t in hook_items)  # the pre_model context
        assert any("after \ufffd" in t for t in hook_items)  # post_tool, surrogate replaced
