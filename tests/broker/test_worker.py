"""BrokerWorker against a hand-driven broker socket (a real ROUTER on ipc): what the
worker does on CANCEL, DISCONNECT, a new broker id, broker silence and budgets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from broker import BrokerWorker, HandlerError, RequestContext, protocol
from tests.helpers import eventually

HB_S = 0.1
LIVENESS = 3


class FakeBroker:
    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.sock.bind(endpoint)
        self.worker = b""
        self.broker_id = "broker-1"
        self.beating = True

    async def heartbeats(self) -> None:
        """Like a real broker: a heartbeat every interval, while ``beating``."""
        while True:
            if self.beating and self.worker:
                await self.send(protocol.Heartbeat(self.broker_id))
            await asyncio.sleep(HB_S)

    async def send(self, msg: protocol.Message) -> None:
        await self.sock.send_multipart([self.worker, *protocol.encode(msg)])

    async def next(self, timeout_s: float = 5.0) -> protocol.Message:
        """The next message from the worker other than a heartbeat."""
        async with asyncio.timeout(timeout_s):
            while True:
                identity, *frames = await self.sock.recv_multipart()
                self.worker = identity
                msg = protocol.decode(frames)
                if not isinstance(msg, protocol.Heartbeat):
                    return msg

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


class Signals:
    """What the handlers saw (made per test: asyncio Events bind to one loop)."""

    def __init__(self) -> None:
        self.held = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def hold(self, ctx: RequestContext) -> bytes:
        self.held.set()
        try:
            await asyncio.Event().wait()  # until cancelled
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return b"never"


async def bad_kind(ctx: RequestContext) -> bytes:
    raise HandlerError("k" * 100, "kind too long for the wire", retryable=True)


Setup = tuple[FakeBroker, BrokerWorker, Signals]


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[Setup]:
    signals = Signals()
    endpoint = f"ipc://{tmp_path}/b" if len(str(tmp_path)) < 90 else "ipc:///tmp/cb-worker-t"
    fake = FakeBroker(endpoint)
    worker = BrokerWorker(endpoint, {"hold": signals.hold, "bad": bad_kind}, capacity=2,
                          heartbeat_interval_s=HB_S, liveness=LIVENESS)
    async with asyncio.TaskGroup() as tg:
        runner = tg.create_task(worker.run())
        beats = tg.create_task(fake.heartbeats())
        try:
            assert isinstance(await fake.next(), protocol.Ready)
            await fake.send(protocol.Heartbeat(fake.broker_id))
            yield fake, worker, signals
        finally:
            runner.cancel()
            beats.cancel()
        fake.close()


async def test_cancel_for_unknown_request_is_still_answered(
    setup: Setup
) -> None:
    fake, _, _ = setup
    await fake.send(protocol.Cancel("ghost"))
    assert await fake.next() == protocol.FailureReply(
        "ghost", "cancelled", "request unknown at the worker", False)


async def test_cancel_cancels_the_handler_and_answers_cancelled(
    setup: Setup
) -> None:
    fake, worker, signals = setup
    await fake.send(protocol.Request("r1", "hold", 30.0, b""))
    await asyncio.wait_for(signals.held.wait(), 5)
    await fake.send(protocol.Cancel("r1"))
    answer = await fake.next()
    assert isinstance(answer, protocol.FailureReply)
    assert (answer.request_id, answer.kind) == ("r1", "cancelled")
    assert signals.cancelled.is_set()
    assert worker.in_flight == 0


PAIRS = 8  # with the one below, within the jobs a capacity-2 worker accepts (2 x 2 + 16)


async def test_cancel_right_behind_its_request_is_still_answered(
    setup: Setup
) -> None:
    # A REQUEST and its CANCEL read in one batch: the handler's task is cancelled
    # before its first step, so its body (and any finally) never runs. The worker
    # must still answer, or the broker holds the slot forever (a leaked slot seen
    # in the 1,000-session test after the broker expired a stalled client).
    fake, worker, _ = setup
    for i in range(PAIRS):
        await fake.sock.send_multipart([fake.worker, *protocol.encode(
            protocol.Request(f"r{i}", "hold", 30.0, b""))])
        await fake.send(protocol.Cancel(f"r{i}"))
    # And certainly in one batch: both handed to the worker in one loop step.
    worker._on_message(protocol.Request("same-step", "hold", 30.0, b""))
    worker._on_message(protocol.Cancel("same-step"))
    answers = {}
    for _ in range(PAIRS + 1):
        msg = await fake.next()
        assert isinstance(msg, protocol.FailureReply)
        answers[msg.request_id] = msg.kind
    assert answers == {**{f"r{i}": "cancelled" for i in range(PAIRS)},
                       "same-step": "cancelled"}

    async def idle() -> bool:
        return worker.in_flight == 0
    await eventually(idle, timeout_s=5, what="no job left at the worker")


async def test_disconnect_abandons_work_and_reregisters(
    setup: Setup
) -> None:
    fake, worker, signals = setup
    await fake.send(protocol.Request("r1", "hold", 30.0, b""))
    await asyncio.wait_for(signals.held.wait(), 5)
    await fake.send(protocol.Disconnect("who are you"))
    # The READY comes next: the abandoned request is not answered to anyone.
    assert isinstance(await fake.next(), protocol.Ready)
    await asyncio.wait_for(signals.cancelled.wait(), 5)
    assert worker.registrations == 2


async def test_new_broker_id_means_reregister(setup: Setup) -> None:
    fake, worker, signals = setup
    fake.broker_id = "broker-2"
    await fake.send(protocol.Heartbeat("broker-2"))
    assert isinstance(await fake.next(), protocol.Ready)
    await fake.send(protocol.Request("r1", "hold", 30.0, b""))
    await asyncio.wait_for(signals.held.wait(), 5)
    assert worker.broker_id == "broker-2"
    assert worker.registrations == 2


async def test_silent_broker_makes_the_worker_reconnect(
    setup: Setup
) -> None:
    fake, worker, _ = setup
    fake.beating = False
    started = time.monotonic()
    # No more heartbeats: after the liveness window the worker says goodbye on the
    # old socket and registers again on a new one.
    assert await fake.next(timeout_s=10) == protocol.Disconnect("worker leaving")
    assert isinstance(await fake.next(timeout_s=10), protocol.Ready)
    assert time.monotonic() - started >= HB_S * (LIVENESS - 1)
    assert worker.registrations == 2


async def test_handler_errors_are_clipped_to_the_wire_bounds(
    setup: Setup
) -> None:
    fake, _, _ = setup
    await fake.send(protocol.Request("r1", "bad", 30.0, b""))
    answer = await fake.next()
    assert isinstance(answer, protocol.FailureReply)
    assert answer.kind == "internal"  # the 100-character kind would not decode
    await fake.send(protocol.Request("r2", "nope", 30.0, b""))
    answer = await fake.next()
    assert isinstance(answer, protocol.FailureReply)
    assert (answer.kind, answer.retryable) == ("bad_request", False)


async def test_worker_enforces_the_budget_as_a_backstop(
    setup: Setup
) -> None:
    fake, _, _ = setup
    await fake.send(protocol.Request("r1", "hold", 0.05, b""))
    answer = await fake.next(timeout_s=10)
    assert isinstance(answer, protocol.FailureReply)
    assert (answer.kind, answer.retryable) == ("timeout", True)


async def test_stop_is_prompt_while_reconnecting_to_an_absent_broker(tmp_path: Path) -> None:
    worker = BrokerWorker("ipc:///tmp/cb-no-broker-here", {"hold": bad_kind},
                          heartbeat_interval_s=HB_S, liveness=LIVENESS)
    async with asyncio.TaskGroup() as tg:
        runner = tg.create_task(worker.run())

        async def backing_off() -> bool:
            # After four sessions ended in silence the backoff is ~0.8 s (±50 %).
            return worker.registrations >= 5 and worker.phase == "backoff"

        await eventually(backing_off, timeout_s=20, what="a reconnect backoff")
        started = time.monotonic()
        await worker.stop(drain_s=1)
        assert runner.done()
        assert time.monotonic() - started < 0.3  # not at the end of the backoff
        assert worker.phase == "stopped"
