"""A worker's slots shared among the brokers it serves (``--broker`` repeated).

A worker with N slots registers with every broker it is given, one
``BrokerWorker`` (one socket, one registration, its own liveness) per broker;
they share one ``SlotPool``. The pool decides how many slots each broker may
fill and tells it (HEARTBEAT ``capacity``, docs/protocol.md), so two brokers
do not both hand the worker N calls:

- Each *live* link (registered and acknowledged, its broker not known to be
  gone) has a target of N // k slots (the first N % k links one more), k the
  number of live links. A link's advertised capacity is what it holds (accepted,
  not answered) plus the free slots given to it: free slots go first to links
  under their target, in list order, then round-robin. The advertised
  capacities of the live links add up to N (or to what they hold, if more).
- A link whose broker is lost (silence, restart) holds nothing (its calls were
  abandoned: that broker failed them as ``worker_lost``) and gets no slots
  until its broker acknowledges a new READY; its share goes to the others.
  READY itself offers one slot (it cannot say 0) until the acknowledgement.
- A slot moves from a broker only while free at the worker, and before the
  answer that frees it is sent (``BrokerWorker._answer``), so a broker's view
  is stale by at most the updates in flight.

Invariant (hard): never more than N handlers run at once, whatever the
brokers believe: every handler runs inside ``slot()``, a semaphore of N. A
request a broker assigned on a stale view (an update crossing a dispatch)
waits there for a slot, within its own budget; that is the only cost of the
race, and it is bounded by the updates in flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from broker.protocol import MAX_CAPACITY

if TYPE_CHECKING:
    from broker.worker import BrokerWorker

log = logging.getLogger(__name__)


class SlotPool:
    """N slots shared by the ``BrokerWorker`` links of one worker process."""

    def __init__(self, capacity: int) -> None:
        if not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"capacity must be in [1, {MAX_CAPACITY}]")
        self.capacity = capacity
        self.links: list[BrokerWorker] = []
        self.running = 0  # handlers inside slot() now
        self.peak = 0  # the most that ever ran at once (tests and STATUS info)
        self.waited = 0  # requests that waited for a slot (a broker's stale view)
        self._sem = asyncio.Semaphore(capacity)
        self._told: dict[int, int] = {}  # id(link) -> capacity its broker was last told

    def add(self, link: BrokerWorker) -> None:
        self.links.append(link)

    # ------------------------------------------------------------------ the hard bound

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one of the N slots while a handler runs."""
        if self._sem.locked():
            self.waited += 1
        async with self._sem:
            self.running += 1
            self.peak = max(self.peak, self.running)
            try:
                yield
            finally:
                self.running -= 1

    # ------------------------------------------------------------------ the advertised split

    def shares(self) -> dict[int, int]:
        """id(link) -> the capacity to advertise to its broker now."""
        live = [link for link in self.links if link.live]
        held = {id(link): link.held for link in self.links}
        caps = dict(held)
        if not live:
            return caps
        free = max(0, self.capacity - sum(held[id(link)] for link in live))
        base, extra = divmod(self.capacity, len(live))
        for i, link in enumerate(live):
            target = base + (1 if i < extra else 0)
            give = min(free, max(0, target - held[id(link)]))
            caps[id(link)] += give
            free -= give
        i = 0
        while free > 0:
            caps[id(live[i % len(live)])] += 1
            free -= 1
            i += 1
        return caps

    def advertised(self, link: BrokerWorker) -> int:
        return min(MAX_CAPACITY, self.shares().get(id(link), 0))

    def registered(self, link: BrokerWorker, capacity: int) -> None:
        """``link`` sent READY with ``capacity``: its broker's view starts there."""
        self._told[id(link)] = capacity
        self.changed()

    def changed(self) -> None:
        """Something moved (a request taken or answered, a broker gained or lost):
        tell each live broker whose share changed its new capacity."""
        caps = self.shares()
        for link in self.links:
            if not link.live:
                continue
            cap = min(MAX_CAPACITY, caps[id(link)])
            if self._told.get(id(link)) != cap:
                self._told[id(link)] = cap
                link.send_capacity(cap)
