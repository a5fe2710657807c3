"""One worker serving two real broker processes (``--broker`` repeated): it registers
with both, answers each call on the broker it came from, never runs more than its
slots across both, and a broker's death leaves the other broker's calls alone."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from broker import BrokerWorker, RequestContext
from broker.brokerset import BrokerSet
from broker.client import BrokerClient
from broker.errors import RequestFailed
from broker.protocol import FailureKind
from broker.slots import SlotPool
from tests.broker.conftest import HB_S, LIVENESS, start_broker
from tests.helpers import BrokerProc, Procs, eventually

pytestmark = pytest.mark.timeout(60)

SLOTS = 4


class Gate:
    """Handlers wait here; the test opens it."""

    def __init__(self) -> None:
        self.open = asyncio.Event()


def handler_for(name: str, gate: Gate) -> Callable[[RequestContext], Any]:
    async def handle(ctx: RequestContext) -> bytes:
        await gate.open.wait()
        return name.encode()  # which broker's link ran it
    return handle


async def worker_capacity(client: BrokerClient) -> int:
    """The capacity the broker has for our one worker (0 when not registered)."""
    status = await client.status()
    workers = status["workers"].get("echo", {}).get("workers", [])
    return int(workers[0]["capacity"]) if workers else 0


@contextlib.asynccontextmanager
async def two_brokers(procs: Procs, ipc_dir: Path) -> AsyncIterator[dict[str, Any]]:
    """Two broker processes, one worker's two links sharing a pool, a client of each
    (one context in the test's own task: TaskGroups do not cross tasks)."""
    brokers = {n: start_broker(procs, f"ipc://{ipc_dir}/{n}-front", f"ipc://{ipc_dir}/{n}-back")
               for n in ("a", "b")}
    gate = Gate()
    pool = SlotPool(SLOTS)
    links = {n: BrokerWorker(b.backend, {"echo": handler_for(n, gate)}, capacity=SLOTS,
                             heartbeat_interval_s=HB_S, liveness=LIVENESS, identity=b"w-shared",
                             pool=pool)
             for n, b in brokers.items()}
    async with asyncio.TaskGroup() as tg:
        runs = [tg.create_task(link.run()) for link in links.values()]
        async with (BrokerClient(brokers["a"].frontend, heartbeat_interval_s=HB_S,
                                 liveness=LIVENESS) as ca,
                    BrokerClient(brokers["b"].frontend, heartbeat_interval_s=HB_S,
                                 liveness=LIVENESS) as cb):
            yield {"brokers": brokers, "links": links, "pool": pool, "gate": gate,
                   "clients": {"a": ca, "b": cb}}
            gate.open.set()
        for link in links.values():
            await link.stop(drain_s=0.5)
        for run in runs:
            run.cancel()


async def split_is(clients: dict[str, BrokerClient], want: dict[str, int]) -> bool:
    got = {n: await worker_capacity(c) for n, c in clients.items()}
    return got == want


async def test_registers_with_both_and_shares_its_slots(procs: Procs, ipc_dir: Path) -> None:
    async with two_brokers(procs, ipc_dir) as two:
        await _shares_its_slots(two)


async def _shares_its_slots(two: dict[str, Any]) -> None:
    clients: dict[str, BrokerClient] = two["clients"]
    pool: SlotPool = two["pool"]
    # Both brokers registered the one worker; its 4 slots are split 2 + 2, not 4 + 4.
    await eventually(lambda: split_is(clients, {"a": 2, "b": 2}), timeout_s=10,
                     what="the worker registered at both brokers with 2 slots each")
    calls = [(n, clients[n].start("echo", b"x", budget_s=20)) for n in ("a", "b")
             for _ in range(6)]
    await eventually(lambda: _true(pool.running == SLOTS), timeout_s=10,
                     what="every slot busy")
    for _ in range(3):  # the brokers hold the rest in their queues, not the worker
        await asyncio.sleep(HB_S)
        assert pool.running == SLOTS
    two["gate"].open.set()
    answers = [(n, await call.result()) for n, call in calls]
    assert answers == [(n, n.encode()) for n, _ in calls]  # each on the broker it came from
    assert pool.peak == SLOTS


async def test_a_broker_killed_leaves_the_other_brokers_calls_alone(
        procs: Procs, ipc_dir: Path) -> None:
    async with two_brokers(procs, ipc_dir) as two:
        await _other_broker_untouched(two)


async def _other_broker_untouched(two: dict[str, Any]) -> None:
    clients: dict[str, BrokerClient] = two["clients"]
    brokers: dict[str, BrokerProc] = two["brokers"]
    pool: SlotPool = two["pool"]
    await eventually(lambda: split_is(clients, {"a": 2, "b": 2}), timeout_s=10,
                     what="2 + 2 slots")
    on_a = [clients["a"].start("echo", b"x", budget_s=20) for _ in range(2)]
    on_b = [clients["b"].start("echo", b"x", budget_s=20) for _ in range(2)]
    await eventually(lambda: _true(pool.running == SLOTS), timeout_s=10, what="4 running")
    os.kill(brokers["a"].proc.pid, signal.SIGKILL)
    for call in on_a:  # the dead broker's calls: worker_lost at its client, as always
        with pytest.raises(RequestFailed) as lost:
            await call.result()
        assert lost.value.failure.kind == FailureKind.WORKER_LOST
    # The worker noticed (its link to a is not live) and gave a's slots to b...
    await eventually(lambda: split_is({"b": clients["b"]}, {"b": SLOTS}), timeout_s=10,
                     what="b given all 4 slots once a is lost")
    # ...while b's calls ran on untouched, and b now fills all 4 slots.
    assert not any(call.done for call in on_b)
    more = [clients["b"].start("echo", b"y", budget_s=20) for _ in range(2)]
    await eventually(lambda: _true(pool.running == SLOTS and all(
        not c.done for c in on_b)), timeout_s=10, what="b's 4 calls running")
    two["gate"].open.set()
    assert [await c.result() for c in on_b + more] == [b"b"] * 4
    assert pool.peak == SLOTS


async def test_the_supervisors_set_moves_off_a_hung_broker_within_its_window(
        procs: Procs, ipc_dir: Path) -> None:
    """SIGSTOP: the broker is silent and nobody restarts it, so the client side alone
    must decide it is lost (silence past ``HB_S * LIVENESS``, checked every HB_S)."""
    async with two_brokers(procs, ipc_dir) as two:
        brokers: dict[str, BrokerProc] = two["brokers"]
        async with BrokerSet([brokers["a"].frontend, brokers["b"].frontend],
                             heartbeat_interval_s=HB_S, liveness=LIVENESS) as bs:
            await eventually(lambda: _true(all(c.connected for c in bs.clients)),
                             timeout_s=10, what="both brokers heard")
            assert bs.current.endpoint == brokers["a"].frontend
            held = [bs.start("echo", b"x", budget_s=20) for _ in range(2)]
            await eventually(lambda: _true(two["pool"].running == 2), timeout_s=10,
                             what="2 calls running through broker a")
            os.kill(brokers["a"].proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            for call in held:  # failed where they were, never moved
                with pytest.raises(RequestFailed) as lost:
                    await call.result()
                assert lost.value.failure.kind == FailureKind.WORKER_LOST
            lost_s = time.monotonic() - t0
            assert bs.current.endpoint == brokers["b"].frontend
            assert bs.moves == 1
            window = HB_S * LIVENESS
            # the window, plus the interval at which silence is checked, plus slack
            # for a loaded machine; the measured figure is in docs/multihost.md
            print(f"calls failed and new calls moved {lost_s:.2f} s after the SIGSTOP "
                  f"(window {window:.2f} s)")
            assert window <= lost_s + HB_S, lost_s
            assert lost_s <= window + HB_S + 1.5, lost_s
            two["gate"].open.set()
            assert await bs.request("echo", b"y", budget_s=10) == b"b"
            os.kill(brokers["a"].proc.pid, signal.SIGKILL)


async def _true(value: bool) -> bool:
    return value


class FakeLink:
    """What the pool reads of a link (pure bookkeeping; the wire is tested above)."""

    def __init__(self, live: bool = True, held: int = 0) -> None:
        self.live = live
        self.held = held
        self.told: list[int] = []

    def send_capacity(self, capacity: int) -> None:
        self.told.append(capacity)


def test_the_split_follows_what_each_broker_holds_and_which_are_live() -> None:
    pool = SlotPool(5)
    a, b = FakeLink(), FakeLink()
    pool.add(a)  # type: ignore[arg-type]
    pool.add(b)  # type: ignore[arg-type]
    assert list(pool.shares().values()) == [3, 2]
    a.held = 5  # b came back while a held everything: b waits for a's slots to free
    assert list(pool.shares().values()) == [5, 0]
    a.held = 4
    assert list(pool.shares().values()) == [4, 1]
    b.live, b.held = False, 0  # b lost: a may fill all 5
    a.held = 1
    assert list(pool.shares().values()) == [5, 0]
    pool.changed()
    assert (a.told, b.told) == ([5], [])  # only live links are told, and only changes
    pool.changed()
    assert a.told == [5]


async def test_never_more_than_the_slots_run_whatever_the_brokers_believe() -> None:
    pool = SlotPool(2)
    gate = asyncio.Event()

    async def run() -> None:
        async with pool.slot():
            await gate.wait()

    async with asyncio.TaskGroup() as tg:
        for _ in range(5):
            tg.create_task(run())
        await eventually(lambda: _true(pool.running == 2 and pool.waited == 3), timeout_s=5,
                         what="2 running, 3 waiting")
        gate.set()
    assert pool.peak == 2
