"""Property tests of the wire codec: round trip, and decode never raising anything
but ProtocolError whatever the frames."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker import protocol

text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)
ids = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1,
              max_size=protocol.MAX_ID_CHARS)
names = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=64)
bodies = st.binary(max_size=512)
# msgpack-invariant values (no tuples, no NaN: they do not compare equal after a round trip)
values: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False) | text | st.binary(max_size=32),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=12,
)

messages: st.SearchStrategy[protocol.Message] = st.one_of(
    st.builds(protocol.Ready, st.lists(names, min_size=1, max_size=8).map(tuple),
              st.integers(1, 4096), st.dictionaries(text, values, max_size=6)),
    st.builds(protocol.Heartbeat, st.text(max_size=protocol.MAX_ID_CHARS,
                                          alphabet=st.characters(blacklist_categories=("Cs",))),
              st.none() | st.integers(0, protocol.MAX_CAPACITY)),
    st.builds(protocol.Disconnect, text),
    st.builds(protocol.Request, ids, names,
              st.floats(min_value=0, allow_nan=False, allow_infinity=False), bodies,
              st.integers(1, 1_000_000)),
    st.builds(protocol.Cancel, ids),
    st.builds(protocol.Partial, ids, st.integers(0, 2**62), bodies),
    st.builds(protocol.Reply, ids, bodies),
    st.builds(protocol.FailureReply, ids, names, text, st.booleans(), bodies),
    st.builds(protocol.Status, ids),
)


@given(messages)
@settings(max_examples=400)
def test_decode_inverts_encode(msg: protocol.Message) -> None:
    assert protocol.decode(protocol.encode(msg)) == msg


def _meta(obj: Any) -> bytes:
    return bytes(msgpack.packb(obj, use_bin_type=True))


kind_bytes = st.sampled_from([bytes((k,)) for k in range(0, 12)]) | st.binary(max_size=3)
headers = st.sampled_from([protocol.HEADER, b"CORRAL/2", b"CORRAL/", b"MDPC01", b""]) | st.binary(
    max_size=12)
metas = st.binary(max_size=64) | st.dictionaries(
    st.sampled_from(["id", "svc", "b", "a", "n", "k", "m", "r", "p", "s", "c", "i"]) | text,
    values, max_size=6).map(_meta) | values.map(_meta)
frame_lists = st.one_of(
    st.lists(st.binary(max_size=64), max_size=6),
    st.tuples(headers, kind_bytes, metas).map(list),
    st.tuples(headers, kind_bytes, metas, bodies).map(list),
)


@given(frame_lists)
@settings(max_examples=1000)
def test_decode_raises_only_protocol_errors(frames: list[bytes]) -> None:
    try:
        msg = protocol.decode(frames, max_bytes=1024)
    except protocol.ProtocolError:
        return
    # Whatever decodes must encode back to frames that decode to the same message.
    assert protocol.decode(protocol.encode(msg)) == msg


def test_version_mismatch_names_both_versions() -> None:
    frames = protocol.encode(protocol.Status("x"))
    frames[0] = b"CORRAL/2"
    with pytest.raises(protocol.VersionMismatch, match=r"version '2'.*version 1"):
        protocol.decode(frames)


def test_oversized_message_is_rejected_before_parsing() -> None:
    frames = protocol.encode(protocol.Reply("x", b"\0" * 2048))
    with pytest.raises(protocol.Oversized):
        protocol.decode(frames, max_bytes=1024)
