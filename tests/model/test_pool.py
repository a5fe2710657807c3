"""ClientShards: the model service's httpx clients, least busy first."""

from __future__ import annotations

import contextlib

import pytest

from sandbox_worker.model.pool import SHARD_CONNECTIONS, ClientShards


def shards(max_connections: int = 100) -> ClientShards:
    return ClientShards(max_connections=max_connections, max_keepalive=32,
                        keepalive_expiry_s=30.0, http2=False, trust_env=False)


async def test_connections_are_split_over_small_shards() -> None:
    pool = shards(100)
    try:
        assert len(pool.clients) == 13  # ceil(100 / 8)
        assert len(shards(1).clients) == 1
        assert len(shards(SHARD_CONNECTIONS).clients) == 1
        assert len(shards(SHARD_CONNECTIONS + 1).clients) == 2
        # the shares add up to exactly the configured limits
        assert sum(c for c, _ in pool.limits) == 100
        assert sum(k for _, k in pool.limits) == 32
        assert max(c for c, _ in pool.limits) <= SHARD_CONNECTIONS
        nine = shards(9)
        assert nine.limits == [(5, 16), (4, 16)]
        await nine.aclose()
        with pytest.raises(RuntimeError, match="closed"):
            async with nine.lease():
                pass
    finally:
        await pool.aclose()


async def test_each_lease_takes_the_least_busy_shard_and_gives_it_back() -> None:
    pool = shards(24)  # 3 shards
    try:
        async with contextlib.AsyncExitStack() as stack:
            held = [await stack.enter_async_context(pool.lease()) for _ in range(4)]
            # spread: 0, 1, 2, then the first of the least busy again
            assert [pool.clients.index(c) for c in held] == [0, 1, 2, 0]
            assert pool.in_flight == [2, 1, 1]
        assert pool.in_flight == [0, 0, 0]
        async with pool.lease() as client:  # idle: the first shard's warm connections
            assert client is pool.clients[0]
        with pytest.raises(RuntimeError):
            async with pool.lease():
                raise RuntimeError("the request failed")
        assert pool.in_flight == [0, 0, 0]
    finally:
        await pool.aclose()
