"""The client endpoint sends failures as data: a ``broker.protocol.Failed`` is
answered with its own kind and message; any other exception is ``internal``
with a fixed message, never its class name or its text (real ROUTER socket,
real DEALER client; the backend behind the endpoint raises on purpose)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from supervisor import wire
from supervisor.server import ClientServer
from supervisor.store.errors import StoreBusy

pytestmark = pytest.mark.timeout(60)


class SecretLookupError(Exception):
    pass


class RaisingBackend:
    """Each call raises: ``submit`` a store failure, ``describe`` a foreign one."""

    async def submit(self, session_id: str, op: dict[str, Any], tenant: str | None) -> str:
        raise StoreBusy("the store stayed busy for 5s")

    async def describe(self, session_id: str, tenant: str | None) -> Any:
        raise SecretLookupError("token=hunter2 in /etc/secret")


async def _call(sock: zmq.asyncio.Socket, call_id: int, call: str,
                args: dict[str, Any]) -> dict[str, Any]:
    await sock.send_multipart(wire.encode({"id": call_id, "call": call, "args": args}))
    async with asyncio.timeout(10):
        while True:
            msg = wire.decode(await sock.recv_multipart())
            if msg.get("id") == call_id:
                return msg


async def test_failures_reach_the_client_as_kind_and_message_only(tmp_path: Path) -> None:
    server = ClientServer(RaisingBackend(), f"ipc://{tmp_path}/sv.sock")  # type: ignore[arg-type]
    endpoint = server.bind()
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    task = asyncio.create_task(server.run())
    try:
        busy = await _call(sock, 1, "submit", {"session_id": "s", "op": {}})
        assert busy["ok"] is False
        assert busy["error"] == {"kind": "store_busy", "message": "the store stayed busy for 5s"}
        foreign = await _call(sock, 2, "describe", {"session_id": "s"})
        assert foreign["ok"] is False
        assert foreign["error"]["kind"] == "internal"
        text = foreign["error"]["message"]
        assert "SecretLookupError" not in text
        assert "hunter2" not in text
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        sock.close()
        ctx.term()
