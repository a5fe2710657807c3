"""SQLITE_BUSY (another connection holds the write lock) and SQLITE_FULL (a size quota
standing in for a full disk), on real files: clear typed errors, never a corrupt state."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, closing, contextmanager
from pathlib import Path
from typing import Any

import pytest

from supervisor.store import StoreBusy, StoreFull
from supervisor.store.store import Store
from tests.helpers import eventually
from tests.store.steps import Session, new_record, tool_round


async def _true(value: bool) -> bool:
    return value


@asynccontextmanager
async def _store_with_session(path: Path, **kw: Any) -> AsyncIterator[tuple[Store, Session]]:
    """A store on ``path`` (opened with ``kw``) holding the new session ``s1``; closed after."""
    store = await Store.open(path, **kw)
    try:
        s = Session("s1")
        await store.create_session(new_record("s1"))
        yield store, s
    finally:
        await store.close()


@contextmanager
def _write_locked(path: Path) -> Iterator[None]:
    """Another connection holds the database's write lock for the block."""
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        other.execute("ROLLBACK")
        other.close()


async def test_busy_past_the_deadline_raises_store_busy(tmp_path: Path) -> None:
    path = tmp_path / "corral.db"
    async with _store_with_session(path, busy_deadline_s=0.5) as (store, s):
        with _write_locked(path):
            started = time.monotonic()
            with pytest.raises(StoreBusy, match="still locked"):
                await store.commit(s.step(tool_round(1), events=[("a", {})]))
            waited = time.monotonic() - started
            assert 0.4 <= waited < 10  # retried up to the deadline, not forever
        # The lock is gone: the same step now commits (nothing partial was left).
        step = Session("s1").step(tool_round(1), events=[("a", {})])
        await store.commit(step)
        loaded = await store.load(s.id)
        assert loaded is not None
        assert loaded.context == tool_round(1)


async def test_busy_then_released_within_the_deadline_commits(tmp_path: Path) -> None:
    path = tmp_path / "corral.db"
    async with _store_with_session(path, busy_deadline_s=30) as (store, s):
        with _write_locked(path):
            commit = asyncio.create_task(store.commit(s.step(tool_round(1))))
            await eventually(lambda: _true(store.busy_retries >= 3), timeout_s=30,
                             what="the commit to hit the lock and back off")
            assert not commit.done()
        await asyncio.wait_for(commit, 30)
        loaded = await store.load(s.id)
        assert loaded is not None
        assert loaded.last_batch_sequence == 1


async def test_cancelled_commit_still_lands_and_the_retry_is_a_noop(tmp_path: Path) -> None:
    """Deterministic form of "a cancelled aiosqlite call may still commit"."""
    path = tmp_path / "corral.db"
    async with _store_with_session(path, busy_deadline_s=30) as (store, s):
        step = s.step(tool_round(1), events=[("tool_call_end", {"call_id": "c1"})])
        with _write_locked(path):
            commit = asyncio.create_task(store.commit(step))
            await eventually(lambda: _true(store.busy_retries >= 1), timeout_s=30,
                             what="the commit to be on the writer and blocked")
            commit.cancel()
            with pytest.raises(asyncio.CancelledError):
                await commit

        async def landed() -> bool:
            loaded = await store.load(s.id)
            return loaded is not None and loaded.last_batch_sequence == 1

        await eventually(landed, timeout_s=30, what="the cancelled commit to land")
        await store.commit(step)  # the engine's retry
        assert [e.sequence for e in await store.replay_events(s.id)] == [1]
        page = await store.transcript_page(s.id)
        assert [b.sequence for b in page.items] == [1]


async def test_full_database_raises_store_full_and_stays_consistent(tmp_path: Path) -> None:
    path = tmp_path / "corral.db"
    store = await Store.open(path, max_db_pages=40)  # 320 KiB with 8 KiB pages
    s = Session("s1")
    committed = 0
    try:
        await store.create_session(new_record("s1"))
        error: StoreFull | None = None
        for n in range(1, 1000):
            step = s.step(tool_round(n), events=[("tool_call_end", {"n": n})])
            try:
                await store.commit(step)
            except StoreFull as exc:
                error = exc
                break
            committed = n
        assert error is not None
        assert "full" in str(error)
        assert committed > 5
        # The failed step left nothing behind; what committed before is intact.
        loaded = await store.load(s.id)
        assert loaded is not None
        assert loaded.last_batch_sequence == committed
        assert loaded.last_event_sequence == committed
        assert loaded.state.next_batch_sequence == committed + 1
        assert loaded.context == [i for n in range(1, committed + 1) for i in tool_round(n)]
    finally:
        await store.close()
    with closing(sqlite3.connect(path)) as raw:
        assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    # With room again (no quota), the very step that failed commits.
    store = await Store.open(path)
    try:
        await store.commit(step)
        loaded = await store.load(s.id)
        assert loaded is not None
        assert loaded.last_batch_sequence == committed + 1
    finally:
        await store.close()


async def test_two_stores_on_one_file_both_commit(tmp_path: Path) -> None:
    """Two writers (e.g. two processes) contend for the write lock: busy is retried and
    every step of both lands, dense."""
    path = tmp_path / "corral.db"
    first = await Store.open(path, busy_deadline_s=30)
    second = await Store.open(path, busy_deadline_s=30)
    try:
        a, b = Session("a"), Session("b")
        await first.create_session(new_record("a"))
        await second.create_session(new_record("b"))

        async def run(store: Store, s: Session) -> None:
            for n in range(1, 41):
                await store.commit(s.step(tool_round(n), events=[("e", {"n": n})]))

        async with asyncio.TaskGroup() as tg:
            tg.create_task(run(first, a))
            tg.create_task(run(second, b))
        for s in (a, b):
            loaded = await first.load(s.id)
            assert loaded is not None
            assert loaded.last_batch_sequence == 40
            assert [e.sequence for e in await second.replay_events(s.id)] == list(range(1, 41))
    finally:
        await first.close()
        await second.close()
