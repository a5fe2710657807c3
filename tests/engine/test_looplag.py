"""The supervisor's loop-lag gauge sees a stalled loop."""

from __future__ import annotations

import asyncio
import time

from supervisor.engine.looplag import LoopLag
from tests.helpers import eventually


async def test_a_blocked_loop_shows_as_lag() -> None:
    lag = LoopLag()
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(lag.run())

        async def ticking() -> bool:
            return lag.ticks >= 2
        await eventually(ticking, timeout_s=5, what="the gauge running")
        time.sleep(0.3)  # noqa: ASYNC251 -- the stall being measured, on purpose

        async def seen() -> bool:
            return lag.max_s >= 0.25
        await eventually(seen, timeout_s=5, what="the 0.3 s stall measured")
        assert lag.window_max_s >= 0.25
        lag.reset()
        assert lag.max_s == 0.0
        assert lag.window_max_s >= 0.25  # the minute's worst stays
        task.cancel()
