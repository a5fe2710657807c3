"""Fuzzing the live broker process: malformed and random frames from both sides
(wrong headers, wrong kinds, bad msgpack, oversized, wrong directions, replies for
unknown ids). Afterwards the broker still serves a normal request and STATUS shows
the drops counted by reason."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgpack
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker import BrokerClient, protocol
from tests.broker.conftest import HB_S, LIVENESS, start_broker, start_echo
from tests.broker.test_protocol_props import frame_lists, messages
from tests.helpers import Procs, eventually

MAX_BYTES = 4096


def dealer(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, identity: bytes
           ) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.connect(endpoint)
    return sock


def fixed_garbage() -> list[list[bytes]]:
    """One of each kind of bad input, so every drop reason is exercised every run."""
    good = protocol.encode(protocol.Request("g1", "fz1", 0.1, b"x"))
    return [
        [b"CORRAL/9", *good[1:]],  # version mismatch
        [b"NOT-CORRAL", *good[1:]],  # not our protocol at all
        [protocol.HEADER, b"\x63", good[2]],  # unknown kind
        [protocol.HEADER, good[1], b"\xc1\xc1"],  # bad msgpack
        [protocol.HEADER, good[1], msgpack.packb([1, 2])],  # metadata not a map
        [protocol.HEADER, good[1], msgpack.packb({"id": 5})],  # bad field types
        [protocol.HEADER],  # too few frames
        [*good, b"extra"],  # too many frames
        [protocol.HEADER, good[1], good[2], b"\0" * (MAX_BYTES + 1)],  # oversized
        protocol.encode(protocol.Partial("nope", 0, b"")),  # wrong direction
    ]


async def _check_broker(frontend: str, expect_dropped: set[str]) -> dict[str, Any]:
    async with BrokerClient(frontend, heartbeat_interval_s=HB_S, liveness=LIVENESS) as client:
        async def echo_served() -> bool:
            return await client.request("echo", b"still serving", budget_s=5) == b"still serving"

        await eventually(echo_served, timeout_s=20, what="echo served after the fuzzing")
        status = await client.status()
        dropped = status["counters"]["dropped"]
        missing = expect_dropped - set(dropped)
        assert not missing, f"drop reasons not counted: {missing} (have {dropped})"
        return status


def test_fuzzed_broker_keeps_serving_and_counts_drops(procs: Procs, ipc_dir: Path) -> None:
    broker = start_broker(procs, f"ipc://{ipc_dir}/f", f"ipc://{ipc_dir}/b",
                          "--max-message-bytes", str(MAX_BYTES))
    start_echo(procs, broker.backend)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    front = dealer(ctx, broker.frontend, b"fuzz-client")
    back = dealer(ctx, broker.backend, b"fuzz-worker")
    stranger = dealer(ctx, broker.backend, b"stranger-worker")
    try:
        for frames in fixed_garbage():
            front.send_multipart(frames, zmq.NOBLOCK)
            back.send_multipart(frames, zmq.NOBLOCK)
        stranger.send_multipart(protocol.encode(protocol.Reply("who", b"?")), zmq.NOBLOCK)
        # A frame far beyond MAXMSGSIZE: libzmq drops the connection, the broker carries on.
        huge = dealer(ctx, broker.frontend, b"huge")
        huge.send_multipart([protocol.HEADER, b"\x04", b"\0" * (MAX_BYTES * 64)], zmq.NOBLOCK)

        @given(st.lists(st.tuples(st.booleans(), frame_lists | messages.map(protocol.encode)),
                        min_size=1, max_size=6))
        @settings(max_examples=300, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow])
        def fuzz(batch: list[tuple[bool, list[bytes]]]) -> None:
            for to_front, frames in batch:
                if not frames:
                    continue
                (front if to_front else back).send_multipart(frames, zmq.NOBLOCK)

        fuzz()
        assert broker.proc.poll() is None, "the broker died while being fuzzed"
        status = asyncio.run(_check_broker(broker.frontend, {
            "version_mismatch", "unknown_kind", "malformed", "oversized", "wrong_direction",
            "unknown_worker",
        }))
        assert broker.proc.poll() is None
        assert status["counters"]["dropped"].get("internal_error", 0) == 0
    finally:
        for sock in (front, back, stranger, huge):
            sock.close()
        ctx.term()


def test_other_version_request_gets_protocol_failure(procs: Procs, ipc_dir: Path) -> None:
    broker = start_broker(procs, f"ipc://{ipc_dir}/f", f"ipc://{ipc_dir}/b")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = dealer(ctx, broker.frontend, b"old-client")
    try:
        frames = protocol.encode(protocol.Request("old-1", "echo", 5.0, b"x"))
        frames[0] = b"CORRAL/0"
        sock.send_multipart(frames)
        answer = None
        for _ in range(20):  # skip the broker's heartbeats
            assert sock.poll(5000), "no answer from the broker"
            msg = protocol.decode(sock.recv_multipart())
            if isinstance(msg, protocol.FailureReply):
                answer = msg
                break
        assert answer is not None
        assert answer.request_id == "old-1"
        assert answer.kind == "protocol"
        assert not answer.retryable
        assert "'0'" in answer.message
        assert "version 1" in answer.message
    finally:
        sock.close()
        ctx.term()
