"""A client process for the vanishing-client test: sends one long request, prints
``started`` once the broker has acknowledged it, then waits to be killed."""

from __future__ import annotations

import asyncio
import sys

from broker import BrokerClient, protocol
from tests.helpers import eventually


async def main(endpoint: str, tag: str) -> None:
    async with BrokerClient(endpoint, heartbeat_interval_s=0.25, liveness=3) as client:
        call = client.start("echo", protocol.pack({"sleep_s": 60, "tag": tag}), budget_s=60)

        async def acknowledged() -> bool:  # the broker's first heartbeat answers our REQUEST
            return client.broker_id is not None

        await eventually(acknowledged, timeout_s=20, what="broker heartbeat")
        print("started", flush=True)
        await call.result()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
