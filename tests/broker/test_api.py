"""The public surface: exported names, STATUS fields, streaming, failures as data,
local deadlines, graceful stops of the broker and of a worker."""

from __future__ import annotations

import asyncio
import signal
import time
import types
from typing import Any

import pytest

import broker
from broker import (
    BrokerClient,
    BrokerUnavailable,
    BrokerWorker,
    HandlerError,
    RequestContext,
    RequestFailed,
    protocol,
)
from broker.echo import make_echo_handler
from tests.broker.conftest import HB_S, LIVENESS, start_echo
from tests.helpers import BrokerProc, Procs, eventually


def client_for(b: BrokerProc) -> BrokerClient:
    return BrokerClient(b.frontend, heartbeat_interval_s=HB_S, liveness=LIVENESS)


def test_exported_members() -> None:
    exported = {name for name in dir(broker) if not name.startswith("_")}
    public = {
        "BrokerClient", "BrokerError", "BrokerUnavailable", "BrokerWorker", "Call",
        "FailureKind", "Handler", "HandlerError", "RequestContext", "RequestFailed",
    }
    assert set(broker.__all__) == public
    # Submodules appear as attributes once imported; everything else must be public API.
    modules = {n for n in exported if isinstance(getattr(broker, n), types.ModuleType)}
    assert exported - modules == public
    for name in public - {"Handler"}:  # Handler is a type alias of a Callable
        assert getattr(broker, name).__module__.startswith("broker.")


async def test_status_has_the_documented_fields(procs: Procs, broker: BrokerProc) -> None:
    worker = start_echo(procs, broker.backend, capacity=2)
    async with client_for(broker) as client:
        await eventually(lambda: _registered(client), what="worker registered")
        assert await client.request("echo", b"one", budget_s=5) == b"one"
        held = client.start("echo", protocol.pack({"sleep_s": 30}), budget_s=20)
        queued = client.start("nobody", b"", budget_s=20)

        async def busy() -> dict[str, object] | None:
            s = await client.status()
            return s if s["workers"]["echo"]["workers"][0]["in_flight"] == 1 else None

        status = await eventually(busy, what="request in flight")
        assert status["broker_id"] == broker.ready["broker_id"] == client.broker_id
        assert status["uptime_s"] > 0
        assert status["heartbeat_interval_s"] == HB_S
        assert status["liveness"] == LIVENESS
        echo = status["workers"]["echo"]
        assert (echo["idle"], echo["busy"]) == (1, 0)  # capacity 2, one slot still free
        (info,) = echo["workers"]
        assert info["identity"] == worker.identity
        assert info["services"] == ["echo"]
        assert info["capacity"] == 2
        assert info["in_flight"] == 1
        assert info["answered"] == 1
        assert 0 <= info["last_seen_s"] < HB_S * LIVENESS
        assert info["info"]["pid"] == worker.proc.pid
        assert {"host", "tier"} <= set(info["info"])
        assert status["worker_count"] == 1
        assert status["queues"] == {"nobody": 1}
        assert status["client_count"] == 1
        assert status["clients"][0]["pending"] == 2
        assert status["requests_tracked"] == 2
        assert status["queued_bytes"] == 0  # the queued request has an empty body
        counters = status["counters"]
        assert counters["requests"] == 3
        assert counters["replies"] == 1
        assert counters["registrations"] == 1
        for key in ("partials", "cancels", "worker_expiries", "client_expiries",
                    "worker_disconnects", "client_disconnects", "client_restarts",
                    "cancel_resends"):
            assert counters[key] == 0
        assert counters["failures"] == {}
        assert counters["dropped"] == {}
        assert counters["faults"] == {}
        await held.cancel()
        await queued.cancel()


async def _registered(client: BrokerClient, count: int = 1) -> bool:
    return int((await client.status())["worker_count"]) == count


async def test_partials_stream_in_order_then_reply(procs: Procs, broker: BrokerProc) -> None:
    start_echo(procs, broker.backend)
    async with client_for(broker) as client:
        body = protocol.pack({"partials": 50})
        call = client.start("echo", body, budget_s=10)
        chunks = [protocol.unpack(c)["i"] async for c in call]
        assert chunks == list(range(50))
        assert call.done
        assert await call.result() == body
        # request() discards partials and returns the reply.
        assert await client.request("echo", body, budget_s=10) == body


async def test_unread_partials_fail_the_call_as_slow_consumer(
    procs: Procs, broker: BrokerProc
) -> None:
    start_echo(procs, broker.backend)
    async with client_for(broker) as client:
        call = client.start("echo", protocol.pack({"partials": 5000}), budget_s=20)
        with pytest.raises(RequestFailed) as failed:
            await call.result()
        assert failed.value.kind == "slow_consumer"
        assert await client.request("echo", b"ok", budget_s=10) == b"ok"


async def test_handler_failures_travel_as_data(procs: Procs, broker: BrokerProc) -> None:
    start_echo(procs, broker.backend)
    async with client_for(broker) as client:
        with pytest.raises(RequestFailed) as failed:
            await client.request("echo", protocol.pack(
                {"fail": "bad_request", "message": "no such tool", "retryable": True}),
                budget_s=5)
        assert (failed.value.kind, failed.value.message, failed.value.retryable) == (
            "bad_request", "no such tool", True)
        with pytest.raises(RequestFailed) as crashed:
            await client.request("echo", protocol.pack({"crash": True}), budget_s=5)
        assert crashed.value.kind == "internal"
        assert not crashed.value.retryable
        assert "Traceback" not in crashed.value.message
        assert "Error" not in crashed.value.message  # no exception name crosses the wire
        assert "\n" not in crashed.value.message


async def test_client_deadline_holds_when_no_broker_answers(tmp_path: object) -> None:
    async with BrokerClient("ipc:///tmp/corral-no-broker-here.sock",
                            heartbeat_interval_s=0.05, liveness=2) as client:
        assert not client.connected
        started = time.monotonic()
        with pytest.raises(RequestFailed) as failed:
            await client.request("echo", b"x", budget_s=0.2)
        elapsed = time.monotonic() - started
        assert failed.value.kind == "timeout"
        assert elapsed < 0.2 + 0.5 + 1.0  # timeout + grace + generous slack
    with pytest.raises(BrokerUnavailable):
        client.start("echo", b"x", budget_s=1)


async def test_closing_the_client_ends_its_calls() -> None:
    client = BrokerClient("ipc:///tmp/corral-no-broker-here.sock")
    async with client:
        call = client.start("echo", b"x", budget_s=30)
    with pytest.raises(RequestFailed) as failed:
        await call.result()
    assert failed.value.kind == "client_closed"


async def test_sigterm_fails_open_requests_and_exits_zero(
    procs: Procs, broker: BrokerProc
) -> None:
    start_echo(procs, broker.backend)
    async with client_for(broker) as client:
        await eventually(lambda: _registered(client), what="worker registered")
        held = client.start("echo", protocol.pack({"sleep_s": 30}), budget_s=20)
        queued = client.start("nobody", b"", budget_s=20)
        await eventually(lambda: _tracked(client, 2), what="both requests tracked")
        broker.proc.send_signal(signal.SIGTERM)
        for call in (held, queued):
            with pytest.raises(RequestFailed) as failed:
                await call.result()
            assert failed.value.kind == "worker_lost"
            assert failed.value.retryable
            assert "shutting down" in failed.value.message
        assert await asyncio.to_thread(broker.proc.wait, 10) == 0


async def _tracked(client: BrokerClient, n: int) -> bool:
    return int((await client.status())["requests_tracked"]) == n


async def test_worker_stop_drains_then_disconnects(broker: BrokerProc) -> None:
    started = asyncio.Event()

    async def slow(ctx: RequestContext) -> bytes:
        started.set()
        await asyncio.sleep(0.3)
        return b"finished " + ctx.body

    async def never(ctx: RequestContext) -> bytes:
        raise HandlerError("bad_request", "never served", retryable=False)

    worker = BrokerWorker(broker.backend, {"slow": slow, "never": never},
                          heartbeat_interval_s=HB_S, liveness=LIVENESS, capacity=2)
    async with client_for(broker) as client, asyncio.TaskGroup() as tg:
        ready = asyncio.Event()
        runner = tg.create_task(worker.run(on_ready=ready.set))
        await asyncio.wait_for(ready.wait(), 10)
        call = client.start("slow", b"job", budget_s=10)
        await asyncio.wait_for(started.wait(), 10)
        await worker.stop(drain_s=5)
        assert runner.done()
        assert await call.result() == b"finished job"  # drained, not failed
        # The worker's DISCONNECT and our STATUS travel on different sockets: no
        # order between them, so wait; the counters then say it was the DISCONNECT
        # (an expiry, had it been lost, would also leave no worker).
        await eventually(lambda: _registered(client, 0), timeout_s=5,
                         what="the worker gone")
        status = await client.status()
        assert status["counters"]["worker_disconnects"] == 1
        assert status["counters"]["worker_expiries"] == 0


async def test_in_process_worker_serves_echo(broker: BrokerProc) -> None:
    worker = BrokerWorker(broker.backend, {"echo": make_echo_handler()},
                          heartbeat_interval_s=HB_S, liveness=LIVENESS)
    async with client_for(broker) as client, asyncio.TaskGroup() as tg:
        ready = asyncio.Event()
        runner = tg.create_task(worker.run(on_ready=ready.set))
        await asyncio.wait_for(ready.wait(), 10)
        assert await client.request("echo", b"in-process", budget_s=5) == b"in-process"
        assert worker.phase == "ready"
        runner.cancel()
    # Cancelling run() says goodbye: the broker forgets the worker at once.
    async with client_for(broker) as client:
        await eventually(lambda: _registered(client, 0), timeout_s=HB_S * LIVENESS,
                         what="worker gone")


async def test_echo_worker_process_stops_gracefully_on_sigterm(
    procs: Procs, broker: BrokerProc
) -> None:
    worker = start_echo(procs, broker.backend)
    async with client_for(broker) as client:
        await eventually(lambda: _registered(client), what="worker registered")
        worker.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(worker.proc.wait, 10) == 0
        # It said goodbye: the broker forgets it on the DISCONNECT, not by expiry.

        async def gone() -> dict[str, Any] | None:
            status = await client.status()
            return status if status["worker_count"] == 0 else None

        status = await eventually(gone, timeout_s=5, what="worker gone")
        assert status["counters"]["worker_disconnects"] == 1
        assert status["counters"]["worker_expiries"] == 0
