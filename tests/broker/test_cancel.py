"""Cancellation and budgets: CANCEL reaches the worker, the client is answered at
once, the worker's slot stays held until it answers, and a late REPLY is never
delivered. A raw DEALER plays the worker where the test needs to misbehave."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq
import zmq.asyncio

from broker import BrokerClient, RequestFailed, protocol
from tests.broker.conftest import HB_S, LIVENESS, start_echo
from tests.helpers import BrokerProc, Procs, eventually


class RawWorker:
    """A hand-driven worker socket: it sends exactly what the test tells it to."""

    def __init__(self, endpoint: str, identity: bytes) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    async def send(self, msg: protocol.Message) -> None:
        await self.sock.send_multipart(protocol.encode(msg))

    async def next(self, timeout_s: float = 5.0) -> protocol.Message:
        """The next message other than a heartbeat (heartbeating meanwhile, to stay alive)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            await self.send(protocol.Heartbeat("raw"))
            if await self.sock.poll(int(HB_S * 1000)):
                msg = protocol.decode(await self.sock.recv_multipart())
                if not isinstance(msg, protocol.Heartbeat):
                    return msg
        raise AssertionError("raw worker got nothing within the deadline")

    async def quiet(self, timeout_s: float) -> bool:
        """True if nothing but heartbeats arrives within ``timeout_s``."""
        try:
            msg = await self.next(timeout_s)
        except AssertionError:
            return True
        raise AssertionError(f"raw worker unexpectedly got {msg}")

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@pytest.fixture
async def raw_worker(broker: BrokerProc) -> AsyncIterator[RawWorker]:
    worker = RawWorker(broker.backend, b"raw-worker")
    try:
        await worker.send(protocol.Ready(("slow",), 1, {"role": "raw"}))
        yield worker
    finally:
        worker.close()


def client_for(broker: BrokerProc) -> BrokerClient:
    return BrokerClient(broker.frontend, heartbeat_interval_s=HB_S, liveness=LIVENESS)


async def test_cancel_reaches_worker_and_late_reply_is_never_delivered(
    broker: BrokerProc, raw_worker: RawWorker
) -> None:
    async with client_for(broker) as client:
        call = client.start("slow", b"work", budget_s=20)
        request = await raw_worker.next()
        assert isinstance(request, protocol.Request)
        assert request.body == b"work"
        await call.cancel()
        with pytest.raises(RequestFailed) as failed:
            await call.result()
        assert failed.value.kind == "cancelled"
        # The worker observes the CANCEL for the request it holds.
        assert await raw_worker.next() == protocol.Cancel(request.request_id)
        # Its slot stays occupied until it answers: a second request waits.
        second = client.start("slow", b"second", budget_s=20)

        async def queued() -> bool:
            return (await client.status())["queues"].get("slow") == 1

        await eventually(queued, what="second request queued behind the cancelled one")
        assert await raw_worker.quiet(2 * HB_S)
        # The late REPLY frees the slot but is never delivered.
        await raw_worker.send(protocol.Reply(request.request_id, b"late"))
        request2 = await raw_worker.next()
        assert isinstance(request2, protocol.Request)
        assert request2.body == b"second"
        await raw_worker.send(protocol.Reply(request2.request_id, b"second done"))
        assert await second.result() == b"second done"
        # A duplicate answer for the same request is dropped too.
        await raw_worker.send(protocol.Reply(request2.request_id, b"again"))
        expected = {"late_answer": 1, "unknown_request": 1}

        async def counted() -> dict[str, Any] | None:
            # The backend and frontend are different sockets: no ordering between them.
            status = await client.status()
            return status if status["counters"]["dropped"] == expected else None

        status = await eventually(counted, what=f"drops counted as {expected}")
        assert status["counters"]["cancels"] == 1
        # Nothing but the broker's ack of our CANCEL reached the client after the fact.
        assert client.dropped == {"late_failure": 1}


async def test_cancel_is_observed_by_a_real_worker_process(
    procs: Procs, broker: BrokerProc
) -> None:
    worker = start_echo(procs, broker.backend, "--events")
    async with client_for(broker) as client:
        call = client.start("echo", protocol.pack({"sleep_s": 60, "tag": "c1"}), budget_s=30)
        assert worker.event() == {"event": "start", "tag": "c1"}
        await call.cancel()
        assert worker.event() == {"event": "cancelled", "tag": "c1"}
        with pytest.raises(RequestFailed, match="cancelled"):
            await call.result()
        # The worker answered FAILURE(cancelled): its slot is free for the next request.
        assert await client.request("echo", b"next", budget_s=5) == b"next"


async def test_budget_exhausted_at_worker_times_out_and_cancels(
    procs: Procs, broker: BrokerProc
) -> None:
    worker = start_echo(procs, broker.backend, "--events")
    async with client_for(broker) as client:
        with pytest.raises(RequestFailed) as failed:
            await client.request("echo", protocol.pack({"sleep_s": 60, "tag": "t"}),
                                 budget_s=0.5)
        assert failed.value.kind == "timeout"
        assert failed.value.retryable
        assert worker.event() == {"event": "start", "tag": "t"}
        assert worker.event() == {"event": "cancelled", "tag": "t"}


async def test_unknown_service_times_out_in_queue(broker: BrokerProc) -> None:
    async with client_for(broker) as client:
        with pytest.raises(RequestFailed) as failed:
            await client.request("nobody-serves-this", b"x", budget_s=0.3)
        assert failed.value.kind == "timeout"
        assert "queue" in failed.value.message


async def test_full_queue_answers_overloaded(procs: Procs, ipc_dir: object) -> None:
    from tests.broker.conftest import start_broker

    small = start_broker(procs, f"ipc://{ipc_dir}/f", f"ipc://{ipc_dir}/b", "--queue-limit", "2")
    async with client_for(small) as client:
        waiting = [client.start("none", b"", budget_s=10) for _ in range(2)]
        with pytest.raises(RequestFailed) as failed:
            await client.request("none", b"", budget_s=10)
        assert failed.value.kind == "overloaded"
        assert failed.value.retryable
        for call in waiting:
            await call.cancel()
