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
- The limits add up to exactly the configured ones: ``max_connections`` and the
  keep-alive cap are each split over the shards as evenly as integers allow.
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
        self.limits = [(_share(max_connections, count, i), _share(max_keepalive, count, i))
                       for i in range(count)]
        self.clients = [
            httpx.AsyncClient(
                http2=http2, trust_env=trust_env, follow_redirects=False,
                limits=httpx.Limits(max_connections=connections,
                                    max_keepalive_connections=keepalive,
                                    keepalive_expiry=keepalive_expiry_s))
            for connections, keepalive in self.limits]
        self.in_flight = [0] * count

    @contextlib.asynccontextmanager
    async def lease(self) -> AsyncIterator[httpx.AsyncClient]:
        if not self.clients:
            raise RuntimeError("the model service's HTTP clients are closed")
        counts = self.in_flight
        i = counts.index(min(counts))
        counts[i] += 1
        try:
            yield self.clients[i]
        finally:
            counts[i] -= 1

    async def aclose(self) -> None:
        clients, self.clients, self.in_flight = self.clients, [], []
        for client in clients:
            await client.aclose()


def _share(total: int, parts: int, i: int) -> int:
    """Part ``i`` of ``total`` split over ``parts`` (the first ones get the remainder)."""
    return total // parts + (1 if i < total % parts else 0)
