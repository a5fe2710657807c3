"""The worker's HTTP clients for model calls: a few httpx clients ("shards")
that share its connections, each request on the least busy one.

Why shards: httpcore's connection pool walks all of its connections, checking
each for expiry (anyio socket attributes, a ``getpeername`` and a ``poll``),
every time a request starts or a response closes. Its CPU per request grows
with the number of open connections. Measured on this machine against the
scripted provider (HTTP/1.1, so one stream per connection): 0.83 ms of client
CPU per streamed request with 4 in flight, 1.5 ms with 16, 3.0 ms with 32. A
worker with 32 model calls in flight paid the 3 ms on every call. Shards of
at most ``SHARD_CONNECTIONS`` connections keep each walk short; over HTTP/2,
each shard multiplexes on its own connection.

Each request goes to the shard with the fewest requests in flight; on a tie,
the lowest index, so a lightly loaded worker keeps reusing the first shard's
warm connections.

Invariants:
- ``in_flight[i]`` counts the leases of shard ``i`` not yet ended; ``lease``
  always gives its count back, on any exit.
- The limits add up to the configured ones: ``max_connections`` is split over
  the shards (rounded up), and so is the keep-alive cap.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator
from typing import Final

import httpx

SHARD_CONNECTIONS: Final = 8


class ClientShards:
    """``lease()`` yields the least busy ``httpx.AsyncClient`` for one request."""

    def __init__(self, *, max_connections: int, max_keepalive: int, keepalive_expiry_s: float,
                 http2: bool, trust_env: bool) -> None:
        if max_connections < 1 or max_keepalive < 0:
            raise ValueError("max_connections must be >= 1 and max_keepalive >= 0")
        count = math.ceil(max_connections / SHARD_CONNECTIONS)
        per_shard = math.ceil(max_connections / count)
        keepalive = math.ceil(max_keepalive / count)
        self.clients = [
            httpx.AsyncClient(
                http2=http2, trust_env=trust_env, follow_redirects=False,
                limits=httpx.Limits(max_connections=per_shard,
                                    max_keepalive_connections=keepalive,
                                    keepalive_expiry=keepalive_expiry_s))
            for _ in range(count)]
        self.in_flight = [0] * count

    @contextlib.asynccontextmanager
    async def lease(self) -> AsyncIterator[httpx.AsyncClient]:
        counts = self.in_flight
        i = counts.index(min(counts))
        counts[i] += 1
        try:
            yield self.clients[i]
        finally:
            counts[i] -= 1

    async def aclose(self) -> None:
        clients, self.clients = self.clients, []
        for client in clients:
            await client.aclose()
