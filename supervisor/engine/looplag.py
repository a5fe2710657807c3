"""How late the supervisor's event loop runs a timer: its responsiveness gauge.

Every session shares one loop. When it runs late, everything runs late:
events reach clients late, and the broker client's heartbeats go out late.
A lag near the broker's client liveness window (10 s by default,
docs/protocol.md) would get the client expired. ``SessionManager.stats``
reports the last lag and the worst one over the last minute
(``corral status``); ``scripts/bench sessions`` reports the worst per level.

Bounds: a fixed ring of ``BUCKETS`` per-interval maxima; one timer per tick.
"""

from __future__ import annotations

import asyncio
import time
from typing import Final

TICK_S: Final = 0.05
BUCKET_S: Final = 10.0
BUCKETS: Final = 6  # the window: BUCKETS x BUCKET_S = 60 s


class LoopLag:
    """``run()`` measures; ``last_s``, ``window_max_s`` and ``max_s`` read it."""

    def __init__(self) -> None:
        self.last_s = 0.0
        self.ticks = 0
        self.max_s = 0.0  # since construction or the last ``reset``
        self._buckets = [0.0] * BUCKETS
        self._bucket = 0
        self._bucket_ends = time.monotonic() + BUCKET_S

    @property
    def window_max_s(self) -> float:
        """The worst lag over the last minute."""
        return max(self._buckets)

    def reset(self) -> None:
        self.max_s = 0.0

    async def run(self) -> None:
        while True:
            start = time.monotonic()
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            lag = max(0.0, now - start - TICK_S)
            self.last_s = lag
            self.ticks += 1
            self.max_s = max(self.max_s, lag)
            while now >= self._bucket_ends:
                self._bucket = (self._bucket + 1) % BUCKETS
                self._buckets[self._bucket] = 0.0
                self._bucket_ends += BUCKET_S
            self._buckets[self._bucket] = max(self._buckets[self._bucket], lag)
