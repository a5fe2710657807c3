"""Leases and fencing on PostgreSQL: a session has one owner at a time; every write is
fenced by the owner's epoch; a writer paused past its lease (a real process, SIGSTOP
then SIGCONT) has every later write refused and gives the session up, while another
takes it over within the lease plus a margin."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from supervisor.store import CheckpointState, LeaseLost, SessionId
from supervisor.store.pg.store import PgStore
from tests.helpers import eventually
from tests.store.backends import empty_pg, supervisor_waits_on_lock
from tests.store.steps import Session, new_record, tool_round

pytestmark = pytest.mark.timeout(90)
LEASE_S = 1.0
MARGIN_S = 2.0


async def _claim_within(store: PgStore, deadline_s: float) -> tuple[list[SessionId], float]:
    started = time.monotonic()
    while time.monotonic() - started < deadline_s:
        got = await store.claim(10)
        if got:
            return got, time.monotonic() - started
        await asyncio.sleep(0.05)
    return [], time.monotonic() - started


async def test_one_owner_at_a_time_and_a_stale_owner_is_refused(pg_database: str) -> None:
    empty_pg(pg_database)
    a = await PgStore.open(pg_database, owner="a", lease_s=LEASE_S)
    b = await PgStore.open(pg_database, owner="b", lease_s=LEASE_S)
    try:
        s = Session("s1")
        await a.create_session(new_record("s1"))
        assert a.held() == {"s1": 1}
        await a.commit(s.step(tool_round(1), events=[("step", {"by": "a"})]))
        with pytest.raises(LeaseLost, match="holds no lease"):
            await b.commit(s.step(tool_round(2)))
        assert await b.claim(10) == []  # a's lease is live
        await a.renew()
        # a stops renewing (paused): b takes the session once the lease lapsed.
        got, _ = await _claim_within(b, LEASE_S + MARGIN_S)
        assert got == ["s1"]
        assert b.held() == {"s1": 2}
        # a's write after the takeover is refused: nothing of it is committed.
        late = s.step(tool_round(2), events=[("step", {"by": "a"})])
        with pytest.raises(LeaseLost, match="epoch 1; the lease now says owner 'b' epoch 2"):
            await a.commit(late)
        # a cannot take it back (b acquired it since a's epoch 1): a gives it up.
        assert await a.reacquire(SessionId("s1"), 1) is None
        assert a.held() == {}
        assert await a.renew() == []
        loaded = await b.load(SessionId("s1"))
        assert loaded is not None
        assert loaded.last_event_sequence == 1
        # b resumes from what is committed and writes on.
        t = Session("s1")
        t.state = CheckpointState.from_json(loaded.state.to_json())
        await b.commit(t.step(tool_round(2), events=[("step", {"by": "b"})]))
        events = await b.replay_events(SessionId("s1"))
        assert [e.payload["by"] for e in events] == ["a", "b"]
        # Each event records the lease it was written under (the chaos checker's
        # ``fencing`` evidence), and a's refused write left no row.
        import psycopg

        with psycopg.connect(pg_database) as conn:
            rows = conn.execute("SELECT sequence, lease_owner, lease_epoch FROM events"
                                " ORDER BY sequence").fetchall()
        assert rows == [(1, "a", 1), (2, "b", 2)]
    finally:
        await a.close()
        await b.close()


async def test_an_expired_lease_refuses_writes_until_taken_back_unchanged(pg_database: str) -> None:
    empty_pg(pg_database)
    a = await PgStore.open(pg_database, owner="a", lease_s=0.3)
    try:
        s = Session("s1")
        await a.create_session(new_record("s1"))
        # Past the lease on the database's clock (nobody else is there to take it):
        # an expired lease is no longer among the live owners.
        async def expired() -> bool:
            return all(owner != "a" for owner, _, _ in await a.lease_owners())
        await eventually(expired, timeout_s=10, what="the lease to expire")
        first = s.step(tool_round(1))
        with pytest.raises(LeaseLost, match="expired"):
            await a.commit(first)
        # Nobody acquired it since (the row still says a, epoch 1): the next renewal
        # takes it back under a new epoch (after a store outage longer than the lease,
        # the supervisor keeps its session), and the write goes through under it.
        assert await a.renew() == []
        assert a.held() == {"s1": 2}
        assert await a.reacquire(SessionId("s1"), 1) == 2  # already back: from memory
        await a.commit(first)  # the same step again: nothing of it was written
        # The write path's own way back: lapse again, then reacquire (as store_commit).
        await eventually(expired, timeout_s=10, what="the lease to expire again")
        second = s.step(tool_round(2))
        with pytest.raises(LeaseLost, match="expired"):
            await a.commit(second)
        assert await a.reacquire(SessionId("s1"), 2) == 3
        await a.commit(second)
        loaded = await a.load(SessionId("s1"))
        assert loaded is not None
        assert loaded.state.next_batch_sequence == 3
    finally:
        await a.close()


def _read_json_line(proc: subprocess.Popen[str], deadline: float) -> dict[str, Any]:
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line:
            return dict(json.loads(line))
        if proc.poll() is not None:
            break
    raise AssertionError(f"no output from the child (exit {proc.poll()})")


async def test_a_writer_paused_past_its_lease_is_fenced_off(pg_database: str,
                                                           tmp_path: Path) -> None:
    """SIGSTOP a real writer process past its lease: another store takes the session
    over within lease + margin; after SIGCONT every write of the paused one is refused,
    it gives the session up, and the journal holds no write of it after the takeover."""
    empty_pg(pg_database)
    with (tmp_path / "child.err").open("w") as err:
        child = subprocess.Popen(  # noqa: ASYNC220 - read from a thread below
            [sys.executable, "-m", "tests.store.lease_child", pg_database, "x", str(LEASE_S)],
            stdout=subprocess.PIPE, stderr=err, text=True)
    b = await PgStore.open(pg_database, owner="b", lease_s=LEASE_S)
    try:
        deadline = time.monotonic() + 30
        seen = [await asyncio.to_thread(_read_json_line, child, deadline) for _ in range(3)]
        assert all("committed" in m for m in seen), seen
        os.kill(child.pid, signal.SIGSTOP)
        got, took_s = await _claim_within(b, LEASE_S + MARGIN_S)
        assert got == ["x"], f"not taken over within {LEASE_S + MARGIN_S}s"
        assert took_s <= LEASE_S + MARGIN_S
        loaded = await b.load(SessionId("x"))
        assert loaded is not None
        t = Session("x")
        t.state = CheckpointState.from_json(loaded.state.to_json())
        takeover_seq = t.state.next_event_sequence
        await b.commit(t.step(tool_round(takeover_seq),
                              events=[("step", {"by": "b", "n": takeover_seq})]))
        os.kill(child.pid, signal.SIGCONT)
        said: list[dict[str, Any]] = []
        deadline = time.monotonic() + 30
        while child.poll() is None or (child.stdout and child.stdout.readable()):
            try:
                said.append(await asyncio.to_thread(_read_json_line, child, deadline))
            except AssertionError:
                break
            if "refused" in said[-1]:
                break
        assert any("refused" in m for m in said), said
        assert await asyncio.to_thread(child.wait, 30) == 0
        events = await b.replay_events(SessionId("x"))
        assert [e.sequence for e in events] == list(range(1, len(events) + 1))
        after = [e.payload["by"] for e in events if e.sequence >= takeover_seq]
        assert after == ["b"], after  # nothing of the paused writer after the takeover
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
        child.wait(10)
        if child.stdout is not None:
            child.stdout.close()
        await b.close()


async def test_renewals_and_claims_do_not_wait_behind_the_writer(pg_database: str) -> None:
    """The writer is stuck (a step waits on a table lock another connection holds): renewing
    and claiming still answer at once, on the lease keeper's own connection, so an
    overloaded supervisor does not let its leases lapse behind its own queue."""
    import psycopg

    empty_pg(pg_database)
    a = await PgStore.open(pg_database, owner="a", lease_s=5.0)
    try:
        s = Session("s1")
        await a.create_session(new_record("s1"))
        await a.create_session(new_record("s2"))
        async with await psycopg.AsyncConnection.connect(pg_database) as db:
            # the step's statement waits before it takes any lease row (a renewal waits,
            # by design, for a write in flight that holds its session's lease FOR SHARE)
            await db.execute("LOCK TABLE events IN ACCESS EXCLUSIVE MODE")
            stuck = asyncio.create_task(a.commit(s.step(tool_round(1))))
            await supervisor_waits_on_lock(db, "the writer to wait on the lock")
            async with asyncio.timeout(5):
                assert await a.renew() == []
                assert await a.claim(10) == []
            assert not stuck.done()
            await db.rollback()
        await asyncio.wait_for(stuck, 10)
    finally:
        await a.close()


async def test_a_lapsed_lease_is_claimed_at_its_expiry_not_at_the_next_period(
        pg_database: str) -> None:
    """The lease keeper asks when the soonest foreign lease lapses and claims then: with
    a claim period of 30 s (a third of a 30 s lease: 10 s between rounds), a session
    whose owner stopped renewing a 1 s lease is taken within a few seconds."""
    from supervisor import leasing

    empty_pg(pg_database)
    b = await PgStore.open(pg_database, owner="b", lease_s=1.0)
    a = await PgStore.open(pg_database, owner="a", lease_s=30.0)
    taken: list[SessionId] = []

    class Engine:
        def give_up(self, sid: SessionId) -> None:
            raise AssertionError(f"a gave up {sid}")

        async def take_over(self, sid: SessionId) -> None:
            taken.append(sid)
    try:
        await b.create_session(new_record("s1"))  # b then stops renewing
        async with asyncio.TaskGroup() as tg:
            keeper = tg.create_task(leasing.run(a, Engine(), claim_period_s=30.0))

            async def claimed() -> bool:
                return taken == ["s1"]
            try:
                await eventually(claimed, timeout_s=6, what="a to take s1 at its lapse")
            finally:
                keeper.cancel()
        assert a.held() == {"s1": 2}
    finally:
        await a.close()
        await b.close()


async def test_claimed_sessions_resume_several_at_a_time_within_the_bound() -> None:
    from supervisor import leasing

    running = peak = 0
    gate = asyncio.Event()
    done: list[SessionId] = []

    class Engine:
        def give_up(self, sid: SessionId) -> None:
            raise AssertionError(sid)

        async def take_over(self, sid: SessionId) -> None:
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            if running == 3:
                gate.set()
            await gate.wait()  # the first three are in flight together
            running -= 1
            done.append(sid)
    sids = [SessionId(f"s{i}") for i in range(10)]
    async with asyncio.timeout(10):
        await leasing.resume(Engine(), sids, "a", 3)
    assert peak == 3
    assert sorted(done) == sorted(sids)
