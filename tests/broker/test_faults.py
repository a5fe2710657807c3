"""The broker's chaos-run frame faults (``--faults``): dropped, delayed and duplicated
request traffic. Every call still ends (never hangs), no answer is delivered twice,
the broker keeps serving and STATUS counts what was injected."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from broker import BrokerClient, RequestFailed
from tests.broker.conftest import HB_S, LIVENESS, start_broker, start_echo
from tests.helpers import Procs, eventually


@pytest.mark.parametrize("kind", ["frame_drop", "frame_delay", "frame_duplicate"])
async def test_frame_faults_never_hang_or_duplicate(
    procs: Procs, ipc_dir: Path, kind: str
) -> None:
    broker = start_broker(procs, f"ipc://{ipc_dir}/f", f"ipc://{ipc_dir}/b",
                          "--faults", f"{kind}:rate=0.3", "--faults-seed", "7")
    start_echo(procs, broker.backend, capacity=8)
    async with BrokerClient(broker.frontend, heartbeat_interval_s=HB_S,
                            liveness=LIVENESS) as client:

        async def registered() -> bool:
            return int((await client.status())["worker_count"]) == 1

        await eventually(registered, what="worker registered")
        outcomes: dict[str, int] = {}
        # A dropped frame ends on the request's deadline: with drops a shorter one
        # (and more requests in flight) keeps the waiting short; the others need
        # every reply, so they keep 1 s of room at 8 in flight.
        budget_s, in_flight = (0.4, 16) if kind == "frame_drop" else (1.0, 8)

        async def one(i: int) -> None:
            body = b"%d" % i
            try:
                reply = await client.request("echo", body, budget_s=budget_s)
            except RequestFailed as exc:
                outcomes[exc.kind] = outcomes.get(exc.kind, 0) + 1
                return
            assert reply == body
            outcomes["ok"] = outcomes.get("ok", 0) + 1

        lanes = asyncio.Semaphore(in_flight)

        async def lane(i: int) -> None:
            async with lanes:
                await one(i)

        async with asyncio.timeout(60), asyncio.TaskGroup() as tg:  # nothing hangs
            for i in range(120):
                tg.create_task(lane(i))
        assert sum(outcomes.values()) == 120
        assert client.dropped["late_reply"] == 0 or kind == "frame_drop"
        status = await client.status()
        injected = status["counters"]["faults"]
        assert injected.get(kind.removeprefix("frame_"), 0) > 0, status["counters"]
        if kind == "frame_drop":
            assert outcomes.get("timeout", 0) > 0  # lost frames end on the deadline
        else:
            assert outcomes == {"ok": 120}  # late or twice on the wire, once to us
        if kind == "frame_duplicate":
            assert status["counters"]["dropped"].get("unknown_request", 0) > 0

        async def slots_free() -> bool:
            s = await client.status()
            return int(s["requests_tracked"]) == 0

        # Slots of dropped answers are recovered (CANCEL at the deadline, answered).
        await eventually(slots_free, timeout_s=10, what="all worker slots free again")
