"""The store's encoding policy: any string reaches the disk as valid UTF-8.

A lone surrogate (which UTF-8 cannot carry) is written as its JSON escape and
reads back as the same string; a plain text column gets U+FFFD. Canonical
JSON (checkpoint digests) follows the same rule, so ``verify`` never raises on
a document that holds one. Property-tested with Hypothesis.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox_worker.api import STORE_ITEM_BYTES, STORE_PAYLOAD_BYTES
from supervisor.export import verify
from supervisor.export.canonical import canonical_bytes, digest
from supervisor.store import SessionStore
from supervisor.store.codec import Limits, decode, encode, text_column
from supervisor.store.errors import InvalidRequest
from supervisor.store.records import (
    CheckpointState,
    EventRecord,
    ExecutionRecord,
    SessionId,
    SessionRecord,
    StepWrite,
    TranscriptBatch,
    TurnId,
)
from tests.store.backends import rows

# No high surrogate directly before a low one: two such code points read back
# as the one character they encode (documented), which equality would trip on.
texts = st.text(alphabet=st.sampled_from(
    ["a", "é", "\x00", '"', "\\", "\ud800", "\udcff", "\udfff", "\U0001f600"]))
values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=20)


def _no_pairs(value: object) -> bool:
    text = json.dumps(value)
    return "\\ud8" not in text or not any(
        f"\\ud8{a}{b}\\udc" in text or f"\\ud8{a}{b}\\udf" in text
        for a in "0123456789abcdef" for b in "0123456789abcdef")


@given(values.filter(_no_pairs))
@settings(max_examples=300, deadline=None)
def test_any_value_encodes_as_utf8_and_reads_back(value: object) -> None:
    text = encode(value, what="v", limit=1 << 20)
    text.encode("utf-8")  # never raises
    assert decode(text) == value


def test_the_default_bounds_come_from_the_worker_api() -> None:
    assert Limits().max_item_bytes == STORE_ITEM_BYTES
    assert Limits().max_payload_bytes == STORE_PAYLOAD_BYTES


@given(values.filter(_no_pairs))
@settings(max_examples=200, deadline=None)
def test_canonical_bytes_never_raise_and_verify_reports_instead(value: object) -> None:
    raw = canonical_bytes(value)
    raw.decode("utf-8")
    assert digest(value) == digest(json.loads(raw))  # stable across a round trip
    doc = {"descriptor": {"schema": "corral.checkpoint", "version": 1,
                          "digest": "sha256:" + "0" * 64, "size": 1},
           "content": {"x": value}}
    assert isinstance(verify(doc), list)


@pytest.mark.timeout(60)
async def test_a_step_full_of_lone_surrogates_commits_and_loads(store: SessionStore) -> None:
    # Both stores: PostgreSQL's driver refused a lone surrogate in a session's route
    # (UnicodeEncodeError from create_session) before the plain columns shared
    # codec.text_column with SQLite.
    sid = SessionId("sess_1")
    # A key cannot be made valid without changing it: a typed refusal.
    bad = SessionId("sess_\udcff")
    with pytest.raises(InvalidRequest, match="lone surrogate"):
        await store.create_session(SessionRecord(bad, 0.0, {}))
    with pytest.raises(InvalidRequest, match="lone surrogate"):
        await store.commit(StepWrite(bad, [EventRecord(bad, 1, "x", {})]))
    config = {"workspace": "/tmp/w\udcff", "route": "r\ud800\x00", "tenant": "t\x00"}
    await store.create_session(
        SessionRecord(sid, 0.0, config),
        StepWrite(sid, [EventRecord(sid, 1, "session_configured", {"a": "\ud800"})],
                  state=CheckpointState(next_event_sequence=2)))
    item = {"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "x\ud800y\udfff"}]}
    await store.commit(StepWrite(
        sid, [EventRecord(sid, 2, "warning", {"message": "\udcff"})],
        TranscriptBatch(sid, 1, 0, [item], 0.0),
        state=CheckpointState(next_event_sequence=3, next_batch_sequence=2),
        execution=ExecutionRecord(sid, TurnId("t"), "failed", 0, 0, 0, {}, 0.0, 1.0, 1.0,
                                  "T2\x00", "failed: \ud800\x00")))
    loaded = await store.load(sid)
    assert loaded is not None
    assert loaded.context == [item]
    events = await store.replay_events(sid)
    assert [e.payload for e in events] == [{"a": "\ud800"}, {"message": "\udcff"}]
    record = await store.get_session(sid)
    assert record is not None
    assert record.config == config  # the JSON keeps it exactly
    (execution,) = (await store.executions_page(sid)).items
    assert (execution.sandbox_tier, execution.reason) == ("T2\ufffd", "failed: \ufffd\ufffd")
    columns = rows(store, "SELECT workspace, route, tenant FROM sessions")
    assert columns == [("/tmp/w\ufffd", "r\ufffd\ufffd", "t\ufffd")]
    assert text_column(None) is None
    assert text_column(3) is None
