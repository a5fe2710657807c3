"""The supervisor's client endpoint under bad input: malformed frames, wrong
protocol, bad calls and a flood of calls never crash it or disturb a good
client (real supervisor process in a real farm)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor import wire
from supervisor.client import SupervisorClient, SupervisorError

pytestmark = pytest.mark.timeout(180)

MSGPACK_INTS = st.integers(min_value=-(2**63), max_value=2**64 - 1)
SCRIPT = {"responses": [{"text": "hello", "usage": {"input": 5, "output": 1}}]}

frames_strategy = st.lists(st.binary(max_size=64), min_size=0, max_size=5) | st.builds(
    lambda body: [wire.HEADER, body], st.binary(max_size=256)) | st.builds(
    lambda obj: [wire.HEADER, msgpack.packb(obj)],
    st.recursive(st.none() | st.booleans() | MSGPACK_INTS | st.text(max_size=20),
                 lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                      max_size=4),
                 max_leaves=12)) | st.builds(
    lambda call, args, cid: [wire.HEADER, msgpack.packb({"id": cid, "call": call,
                                                         "args": args})],
    st.sampled_from([*sorted(wire.CALLS), "nope", ""]),
    st.dictionaries(st.sampled_from(["session_id", "op", "spec", "sub", "limit",
                                     "after_sequence"]),
                    st.none() | MSGPACK_INTS | st.text(max_size=10) | st.dictionaries(
                        st.text(max_size=5), MSGPACK_INTS, max_size=3), max_size=4),
    st.integers(min_value=-5, max_value=2**64 - 1))


def _raw_dealer(endpoint: str) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, os.urandom(8))
    sock.connect(endpoint)
    return sock


async def test_fuzzed_frames_never_crash_the_supervisor(start_farm: Callable[..., Any],
                                                        workspace_root: Path) -> None:
    farm = await start_farm(SCRIPT, workers=1)
    pid = farm.pid("supervisor")
    raw = _raw_dealer(farm.endpoint)
    sent = 0

    @settings(max_examples=300, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(frames_strategy)
    def fuzz(frames: list[bytes]) -> None:
        nonlocal sent
        if frames:
            raw.send_multipart(frames)
            sent += 1

    try:
        fuzz()
    finally:
        raw.close()
    assert sent > 100
    ws = workspace_root / "ws"
    ws.mkdir()
    async with SupervisorClient(farm.endpoint) as sv:
        status = await sv.status()
        sid = await sv.create_session(workspace=str(ws))
        sub = await sv.submit(sid, {"type": "user_input", "text": "still there?"})
        async with asyncio.timeout(60):
            async for e in sv.events(sid):
                if e.get("submission_id") == sub and e["type"] == "turn_complete":
                    break
    assert farm.pid("supervisor") == pid, "the supervisor restarted: it crashed"
    assert status["client_endpoint"]["bad_frames"] > 0


async def test_bad_calls_get_typed_errors(start_farm: Callable[..., Any],
                                          workspace_root: Path) -> None:
    farm = await start_farm(SCRIPT, workers=1)
    async with SupervisorClient(farm.endpoint) as sv:
        with pytest.raises(SupervisorError) as info:
            await sv.submit("sess_nope", {"type": "user_input", "text": "x"})
        assert info.value.kind == "unknown_session"
        with pytest.raises(SupervisorError) as info:
            await sv.create_session(workspace="relative/path")
        assert info.value.kind == "bad_request"
        with pytest.raises(SupervisorError) as info:
            await sv.create_session(workspace=str(workspace_root), frobnicate=True)
        assert "frobnicate" in info.value.message
        ws = workspace_root / "ws"
        ws.mkdir()
        sid = await sv.create_session(workspace=str(ws))
        with pytest.raises(SupervisorError) as info:
            await sv.submit(sid, {"type": "user_input", "txt": "typo"})
        assert info.value.kind in ("bad_op", "bad_request")
        with pytest.raises(SupervisorError) as info:
            await sv.call("subscribe", session_id=sid)  # no subscription id
        assert info.value.kind == "bad_request"
        # The session is unharmed by all of that.
        sub = await sv.submit(sid, {"type": "user_input", "text": "ok"})
        async with asyncio.timeout(60):
            async for e in sv.events(sid):
                if e.get("submission_id") == sub and e["type"] == "turn_complete":
                    break


async def test_a_call_flood_is_bounded_and_answered(start_farm: Callable[..., Any]) -> None:
    farm = await start_farm(SCRIPT, workers=1)
    async with SupervisorClient(farm.endpoint, timeout_s=30) as sv:
        results = await asyncio.gather(*(sv.status() for _ in range(600)),
                                       return_exceptions=True)
    answered = [r for r in results if isinstance(r, dict)]
    refused = [r for r in results if isinstance(r, SupervisorError) and r.kind == "bad_request"]
    assert len(answered) + len(refused) == 600, [r for r in results if not isinstance(r, dict)][:3]
    assert answered
