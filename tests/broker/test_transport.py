"""``AsyncDealer.listen``: dispatch from the fd's reader callback, bounded per
callback, edge re-arming, and how reading ends (handler error, cancel, close).
A real ROUTER socket in the test's thread talks to the dealer over ipc://."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq

from broker.errors import BrokerUnavailable
from broker.transport import AsyncDealer
from tests.helpers import wait_until

IDENTITY = b"dealer-1"


class Peer:
    """The ROUTER end: sends to the dealer by identity."""

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self.sock = sock

    def send(self, *bodies: bytes) -> None:
        for body in bodies:
            self.sock.send_multipart([IDENTITY, body])


@pytest.fixture
async def pair(ipc_dir: Path) -> AsyncIterator[tuple[Peer, AsyncDealer]]:
    endpoint = f"ipc://{ipc_dir}/t"
    router: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.bind(endpoint)
    dealer = AsyncDealer(endpoint, identity=IDENTITY)
    try:
        # The ROUTER can route to the dealer once it has heard from it.
        assert dealer.send([b"hello"])
        assert router.poll(10_000), "the router never heard the dealer"
        assert router.recv_multipart() == [IDENTITY, b"hello"]
        yield Peer(router), dealer
    finally:
        dealer.close()
        router.close()


async def test_listener_dispatches_all_in_order_in_bounded_batches(
        pair: tuple[Peer, AsyncDealer]) -> None:
    peer, dealer = pair
    n, limit = 3000, 7
    got: list[bytes] = []
    trace: list[str] = []
    done = asyncio.Event()

    def on_batch(batch: list[list[bytes]]) -> None:
        assert asyncio.current_task() is None  # a loop callback, not a task
        assert 0 < len(batch) <= limit
        trace.append("batch")
        got.extend(frames[0] for frames in batch)
        if len(got) >= n:
            done.set()

    async def ticker() -> None:
        while not done.is_set():
            trace.append("tick")
            await asyncio.sleep(0)

    peer.send(*(str(i).encode() for i in range(n)))
    listening = dealer.listen(on_batch, limit=limit)
    tick = asyncio.create_task(ticker())
    async with asyncio.timeout(20):
        await done.wait()
    await tick
    assert got == [str(i).encode() for i in range(n)]
    # The listener yields to the loop between bounded batches: other work runs.
    first, last = trace.index("batch"), len(trace) - 1 - trace[::-1].index("batch")
    assert "tick" in trace[first:last]
    assert not listening.done()
    listening.cancel()


async def test_has_input_rearms_the_listener(pair: tuple[Peer, AsyncDealer]) -> None:
    """``has_input`` reads EVENTS, which consumes the fd's edge; the message still
    gets dispatched (the listener is rescheduled), without any later send."""
    peer, dealer = pair
    got = asyncio.Event()
    listening = dealer.listen(lambda batch: got.set())
    await asyncio.sleep(0)  # the initial pump ran: nothing to read yet
    peer.send(b"x")
    wait_until(dealer.has_input, timeout_s=10, interval_s=0.001, what="input waiting")
    async with asyncio.timeout(10):
        await got.wait()
    listening.cancel()


async def test_handler_error_ends_listening_and_stops_dispatch(
        pair: tuple[Peer, AsyncDealer]) -> None:
    peer, dealer = pair
    calls = 0

    def on_batch(batch: list[list[bytes]]) -> None:
        nonlocal calls
        calls += 1
        raise ValueError("dispatch bug")

    listening = dealer.listen(on_batch)
    peer.send(b"one")
    with pytest.raises(ValueError, match="dispatch bug"):
        async with asyncio.timeout(10):
            await listening
    # Reading continues only through recv_batch; the failed handler is not called.
    peer.send(b"two")
    async with asyncio.timeout(10):
        rest = [frames[0] for frames in await dealer.recv_batch()]
    while rest[-1] != b"two":
        async with asyncio.timeout(10):
            rest += [frames[0] for frames in await dealer.recv_batch()]
    assert calls == 1


async def test_a_handler_raising_stopiteration_still_ends_listening(
        pair: tuple[Peer, AsyncDealer]) -> None:
    """A future refuses StopIteration; it must not escape the callback instead
    (asyncio would only log it, and the listening future would hang)."""
    peer, dealer = pair

    def on_batch(batch: list[list[bytes]]) -> None:
        next(iter(()))  # a dispatch bug: StopIteration

    listening = dealer.listen(on_batch)
    peer.send(b"one")
    with pytest.raises(RuntimeError, match="StopIteration") as raised:
        async with asyncio.timeout(10):
            await listening
    assert isinstance(raised.value.__cause__, StopIteration)


async def test_cancelling_the_supervising_task_stops_dispatch_at_once(
        pair: tuple[Peer, AsyncDealer]) -> None:
    peer, dealer = pair
    got: list[bytes] = []
    first = asyncio.Event()

    def on_batch(batch: list[list[bytes]]) -> None:
        got.extend(frames[0] for frames in batch)
        first.set()

    async def reader() -> None:
        await dealer.listen(on_batch)

    task = asyncio.create_task(reader())
    peer.send(b"a")
    async with asyncio.timeout(10):
        await first.wait()
    peer.send(b"b")
    wait_until(dealer.has_input, timeout_s=10, interval_s=0.001, what="input waiting")
    task.cancel()  # synchronously cancels the awaited future: no dispatch after this
    with pytest.raises(asyncio.CancelledError):
        await task
    async with asyncio.timeout(10):
        assert [frames[0] for frames in await dealer.recv_batch()] == [b"b"]
    assert got == [b"a"]


async def test_close_ends_listening_with_broker_unavailable(
        pair: tuple[Peer, AsyncDealer]) -> None:
    _peer, dealer = pair
    listening = dealer.listen(lambda batch: None)
    with pytest.raises(RuntimeError):
        dealer.listen(lambda batch: None)
    dealer.close()
    with pytest.raises(BrokerUnavailable):
        await listening
