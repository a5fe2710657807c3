"""PostgreSQL restarted while a store's connections sat idle: once it is back, the
first write, the first read and the first lease renewal succeed. Each connection's
first use after the restart once failed with ``StoreUnavailable`` ("server closed the
connection unexpectedly"): psycopg learns of a closed idle connection only at its next
statement (seen by hand: a ``corral run`` 9 s after PostgreSQL came back failed).

The cluster is this module's own (it is restarted) and is stopped by its pid."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from supervisor.store import SessionId
from supervisor.store.pg.store import PgStore
from tests.conftest import running_pg
from tests.store.steps import Session, new_record, tool_round

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def own_pg() -> Iterator[Any]:
    yield from running_pg()


@pytest.mark.parametrize("owner", [None, "sv-a"])
async def test_the_first_statements_after_a_restart_succeed(own_pg: Any,
                                                            owner: str | None) -> None:
    url = own_pg.new_database()
    store = await PgStore.open(url, owner=owner, lease_s=60)
    try:
        await store.create_session(new_record("s1"))
        s = Session("s1")
        await store.commit(s.step(tool_round(1), events=[("step", {"n": 1})]))
        assert await store.get_session(SessionId("s1")) is not None
        if owner is not None:
            assert await store.renew() == []
        own_pg.restart()  # immediate shutdown, then up again on the same port
        # Back: each connection's first use goes through (no StoreUnavailable).
        if owner is not None:
            assert await store.renew() == []
        await store.commit(s.step(tool_round(2), events=[("step", {"n": 2})]))
        loaded = await store.load(SessionId("s1"))
        assert loaded is not None
        page = await store.events_page(SessionId("s1"))
        assert [e.payload for e in page.items] == [{"n": 1}, {"n": 2}]
    finally:
        await store.close()
        own_pg.drop_database(url)
