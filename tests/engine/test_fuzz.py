"""Fuzzed ops never crash the manager or a session (Hypothesis)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.engine import BadOp, EngineError, SessionClosed
from supervisor.engine.ops import parse_op
from tests.engine.farm import engine, start_farm
from tests.helpers import Procs, eventually

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)

KEYS = ["type", "text", "attachments", "turn_id", "id", "decision", "route", "extra"]
TYPES = ["user_input", "interrupt", "exec_approval", "set_model", "compact", "nonsense", ""]


def op_strategy(allow_shutdown: bool) -> st.SearchStrategy[Any]:
    types = TYPES + (["shutdown"] if allow_shutdown else [])
    near = st.fixed_dictionaries(
        {"type": st.sampled_from(types)},
        optional={k: json_values | st.text(max_size=40) for k in KEYS if k != "type"})
    valid = st.one_of(
        st.builds(lambda t: {"type": "user_input", "text": t}, st.text(min_size=1, max_size=50)),
        st.builds(lambda i, d: {"type": "exec_approval", "id": i, "decision": d},
                  st.text(min_size=1, max_size=10),
                  st.sampled_from(["approved", "denied", "abort", "approved_for_session"])),
        st.builds(lambda t: {"type": "interrupt", "turn_id": t}, st.text(min_size=1, max_size=10)),
        st.builds(lambda r: {"type": "set_model", "route": r}, st.sampled_from(["main", "x"])),
        st.just({"type": "compact"}),
    )
    return st.one_of(near, valid, json_values)


@given(op_strategy(allow_shutdown=True))
@settings(max_examples=500, database=None, deadline=None)
def test_parse_op_raises_only_bad_op(op: Any) -> None:
    try:
        parse_op(op)
    except BadOp as exc:
        message = str(exc)
    else:
        message = "accepted"
    assert message  # a refusal always says what is wrong


async def test_fuzzed_ops_never_crash_the_manager_or_a_session(procs: Procs,
                                                               tmp_path: Path) -> None:
    ops: list[Any] = []

    @given(op_strategy(allow_shutdown=False))
    @settings(max_examples=150, database=None, deadline=None)
    def collect(op: Any) -> None:
        ops.append(op)

    collect()
    farm = start_farm(procs, tmp_path, {"responses": [{"text": f"r{i}"} for i in range(400)]},
                      services="model")
    async with engine(farm) as eng:
        sid = await eng.session()
        other = await eng.session()
        accepted = rejected = 0
        for op in ops:
            try:
                await eng.manager.submit(sid, op)
                accepted += 1
            except EngineError:
                rejected += 1
        assert accepted + rejected == len(ops)
        # the fuzzed session drains its queue and still serves a normal turn
        session = eng.manager.sessions[sid]

        async def idle() -> bool:
            return session.driver is None

        await eventually(idle, timeout_s=60, what="the fuzzed session to drain its queue")
        last = (await eng.store.replay_events(sid))[-1].sequence
        done = await eng.run_until(sid, {"type": "user_input", "text": "still fine?"},
                                   after_sequence=last)
        assert done[-1].type == "turn_complete"
        # and the other session never noticed
        ok = await eng.run_until(other, {"type": "user_input", "text": "hello"})
        assert ok[-1].type == "turn_complete"
        replay = await eng.store.replay_events(sid)
        assert [e.sequence for e in replay] == list(range(1, len(replay) + 1))
        # a shutdown closes the session for good; further ops are refused with a type
        await eng.manager.submit(sid, {"type": "shutdown"})

        async def closed() -> bool:
            return session.closed

        await eventually(closed, timeout_s=20, what="the session to close")
        with pytest.raises(SessionClosed, match="shut down"):
            await eng.manager.submit(sid, {"type": "user_input", "text": "x"})
