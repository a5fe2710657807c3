"""The PostgreSQL store writes an ordinary step in ONE statement (``pg/onestep.py``) and
keeps every rule of the slow path: the same answers for re-writes and conflicts, and
the fence checked inside that one statement (FOR SHARE on the lease row, owner, epoch
and expiry), so a stale owner's step writes nothing.

The store-guarantee tests (tests/store, both backends) run through the same path; these
pin that the one-statement path is really taken, and its fence on its own."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from supervisor.store import LeaseLost, SequenceConflict, SessionId
from supervisor.store.pg import onestep
from supervisor.store.pg.store import PgStore
from tests.store.backends import empty_pg, supervisor_waits_on_lock
from tests.store.steps import Session, execution, new_record, tool_round

pytestmark = pytest.mark.timeout(60)


async def test_ordinary_steps_take_one_statement_and_others_the_full_rules(
        pg_database: str) -> None:
    empty_pg(pg_database)
    store = await PgStore.open(pg_database)
    try:
        s = Session("s1")
        await store.create_session(new_record("s1"))
        before = dict(onestep.COUNTS)
        steps = [s.step(tool_round(n), events=[("step", {"n": n}), ("more", {"n": n})],
                        execution=execution("s1", "t1", "running"))
                 for n in range(1, 6)]
        for step in steps:
            await store.commit(step)
        assert onestep.COUNTS["one_statement"] - before.get("one_statement", 0) == 5
        assert onestep.COUNTS["slow"] == before.get("slow", 0)
        # an identical re-write: the slow path's idempotent no-op
        await store.commit(steps[2])
        assert onestep.COUNTS["slow"] == before.get("slow", 0) + 1
        # different content under a stored sequence: refused, nothing written
        other = Session("s1")
        with pytest.raises(SequenceConflict):
            await store.commit(other.step(tool_round(9), events=[("other", {})]))
        loaded = await store.load(SessionId("s1"))
        assert loaded is not None
        assert (loaded.last_event_sequence, loaded.last_batch_sequence) == (10, 5)
        assert loaded.state.next_event_sequence == 11
        events = await store.replay_events(SessionId("s1"))
        assert [e.payload["n"] for e in events] == [n for n in range(1, 6) for _ in (0, 1)]
    finally:
        await store.close()


async def test_the_one_statement_checks_the_fence_itself(pg_database: str) -> None:
    """A lease taken from under the owner between two of its steps: the stale owner's
    next step, of the ordinary shape, writes nothing (the statement's fence) and is
    refused; a step in flight holds the lease row, so the takeover waits for it."""
    empty_pg(pg_database)
    a = await PgStore.open(pg_database, owner="a", lease_s=5.0)
    try:
        s = Session("s1")
        await a.create_session(new_record("s1"))
        await a.commit(s.step(tool_round(1), events=[("step", {"by": "a"})]))
        async with await psycopg.AsyncConnection.connect(pg_database, autocommit=True) as db:
            await db.execute("UPDATE leases SET owner = 'b', epoch = epoch + 1")
            before = onestep.COUNTS["slow"]
            late = s.step(tool_round(2), events=[("step", {"by": "a"})])
            with pytest.raises(LeaseLost, match="owner 'b' epoch 2"):
                await a.commit(late)
            assert onestep.COUNTS["slow"] == before + 1  # the statement wrote nothing
            cur = await db.execute("SELECT count(*) FROM events")
            assert await cur.fetchone() == (1,)
            # Back to a; a takeover (an UPDATE of the lease row) waits while a's group
            # holds the row FOR SHARE: it ends only after a's step committed.
            await db.execute("UPDATE leases SET owner = 'a', epoch = 1")
            async with db.transaction():
                await db.execute("SELECT 1 FROM leases FOR UPDATE")  # hold a's group
                commit = asyncio.create_task(a.commit(late))
                await supervisor_waits_on_lock(db, "a's step to wait on the lease")
                assert not commit.done()
            await asyncio.wait_for(commit, 10)
            cur = await db.execute("SELECT count(*) FROM events")
            assert await cur.fetchone() == (2,)
    finally:
        await a.close()


async def test_a_group_pipelines_distinct_sessions_and_orders_one_sessions_steps(
        pg_database: str) -> None:
    empty_pg(pg_database)
    store = await PgStore.open(pg_database)
    try:
        sessions = [Session(f"s{i}") for i in range(3)]
        for s in sessions:
            await store.create_session(new_record(str(s.id)))
        a, b, c = sessions
        steps = [a.step(tool_round(1), events=[("e", {"n": 1})]),
                 b.step(tool_round(1), events=[("e", {"n": 1})]),
                 a.step(tool_round(2), events=[("e", {"n": 2})]),  # a new run: sees a's first
                 c.step(tool_round(1), events=[("e", {"n": 1})]),
                 b.step(tool_round(2), events=[("e", {"n": 2})])]
        groups = store.groups_committed
        before = onestep.COUNTS["one_statement"]
        await store.commit_many(steps)
        assert store.groups_committed == groups + 1
        assert onestep.COUNTS["one_statement"] == before + 5
        for s, n in ((a, 2), (b, 2), (c, 1)):
            events = await store.replay_events(s.id)
            assert [e.payload["n"] for e in events] == list(range(1, n + 1))
    finally:
        await store.close()


async def test_a_concurrent_writers_row_reruns_the_group_the_slow_way(
        pg_database: str) -> None:
    """Another connection inserts the step's event first: the one statement fails on the
    key, the group is run again with savepoints, and the step's answer is the slow
    path's (here: the identical event is a no-op, the rest of the step is written)."""
    empty_pg(pg_database)
    store = await PgStore.open(pg_database)
    try:
        s = Session("s1")
        await store.create_session(new_record("s1"))
        step = s.step(tool_round(1), events=[("e", {"n": 1})])
        ev = step.events[0]
        async with await psycopg.AsyncConnection.connect(pg_database) as db:
            await db.execute(
                "INSERT INTO events (sid, sequence, type, submission_id, created_at, payload)"
                " SELECT sid, %s, %s, NULL, 0, %s FROM sessions WHERE session_id = 's1'",
                (ev.sequence, ev.type, '{"n":1}'))
            reruns = onestep.COUNTS["groups_rerun"]
            commit = asyncio.create_task(store.commit(step))
            await supervisor_waits_on_lock(db, "the step to wait on the key")
            await db.commit()
        await asyncio.wait_for(commit, 10)
        assert onestep.COUNTS["groups_rerun"] == reruns + 1
        loaded = await store.load(SessionId("s1"))
        assert loaded is not None
        assert (loaded.last_event_sequence, loaded.last_batch_sequence) == (1, 1)
    finally:
        await store.close()
