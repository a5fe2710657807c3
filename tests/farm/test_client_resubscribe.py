"""A subscribe the client gave up on (the server answered after the call's
deadline) is withdrawn, so retries against a slow supervisor never pile up
subscriptions on it (they once reached its per-client cap of 256 in a soak).

The supervisor here is a real ROUTER socket speaking the client protocol,
scripted to answer every ``subscribe`` late."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from supervisor import wire
from supervisor.client import SupervisorClient, SupervisorUnavailable

pytestmark = pytest.mark.timeout(60)

SLOW_S = 2.5  # longer than the client's 2 s subscribe deadline


async def _slow_server(sock: zmq.asyncio.Socket, live: set[int], seen: list[str],
                       emptied: asyncio.Event) -> None:
    """Answer hello at once; take each subscribe on arrival (as the real server
    does: its calls start in arrival order) but answer it after ``SLOW_S``."""

    async def late(identity: bytes, call_id: int, sub: int) -> None:
        await asyncio.sleep(SLOW_S)
        await sock.send_multipart([identity, *wire.encode(
            {"id": call_id, "ok": True, "result": sub, "srv": "s1"})])

    async with asyncio.TaskGroup() as tg:
        while True:
            identity, *frames = await sock.recv_multipart()
            msg = wire.decode(frames)
            call, args = msg.get("call"), msg.get("args", {})
            seen.append(str(call))
            if call == "subscribe":
                live.add(args["sub"])
                tg.create_task(late(identity, msg["id"], args["sub"]))
            elif call == "unsubscribe":
                live.discard(args["sub"])
                if not live:
                    emptied.set()
            elif call != "ping":
                await sock.send_multipart([identity, *wire.encode(
                    {"id": msg["id"], "ok": True, "result": None, "srv": "s1"})])


async def test_a_late_subscribe_is_withdrawn(tmp_path: Path) -> None:
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/sv.sock"
    sock.bind(endpoint)
    live: set[int] = set()
    seen: list[str] = []
    emptied = asyncio.Event()
    server = asyncio.ensure_future(_slow_server(sock, live, seen, emptied))
    try:
        async with SupervisorClient(endpoint, timeout_s=5.0, liveness_s=30.0) as client:
            events = client.events("s", reconnect_timeout_s=7.0)
            with contextlib.suppress(SupervisorUnavailable):
                async with asyncio.timeout(20):
                    await events.__anext__()
            await events.aclose()
            # every subscribe the server took late was withdrawn by the client
            async with asyncio.timeout(10):
                while live:
                    emptied.clear()
                    await emptied.wait()
        assert seen.count("subscribe") >= 2, seen  # it did retry
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server
        sock.close()
