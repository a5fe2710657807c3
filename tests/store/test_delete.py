"""``Store.delete_session`` (``corral delete``): every row of the session goes, in
one transaction, and a new session that reuses its sid sees none of them."""

from __future__ import annotations

import pytest

from supervisor.store import SessionId, SessionStore
from supervisor.store.errors import SessionNotFound
from tests.store.backends import row_count
from tests.store.steps import Session, new_record, tool_round

TABLES = ("sessions", "checkpoint_state", "transcript_batches", "context_rewrites",
          "events", "executions")


async def _count(store: SessionStore) -> dict[str, int]:
    return {t: row_count(store, t) for t in TABLES}


@pytest.mark.timeout(30)
async def test_delete_removes_every_row_and_the_sid_can_be_reused(store: SessionStore) -> None:
    keep, gone = Session("keep"), Session("gone")
    for s in (keep, gone):
        await store.create_session(new_record(s.id), s.step(events=[("session_configured", {})]))
        await store.commit(s.step(tool_round(1), events=[("turn_started", {"n": 1})]))
        await store.commit(s.step(tool_round(2), rewrite=([{"type": "message"}], ["compaction"]),
                                  events=[("turn_complete", {})]))
    before = await _count(store)
    await store.delete_session(SessionId("gone"))
    after = await _count(store)
    assert after["sessions"] == 1
    assert all(after[t] * 2 == before[t] for t in TABLES if t != "executions"), (before, after)
    assert await store.get_session(SessionId("gone")) is None
    assert (await store.load(SessionId("keep"))) is not None
    with pytest.raises(SessionNotFound):
        await store.delete_session(SessionId("gone"))

    # The next session takes the freed sid: it must not see the deleted rows.
    fresh = Session("fresh")
    await store.create_session(new_record(fresh.id), fresh.step(events=[("hello", {})]))
    page = await store.events_page(SessionId("fresh"), after_sequence=0, limit=100)
    assert [e.type for e in page.items] == ["hello"]
    loaded = await store.load(SessionId("fresh"))
    assert loaded is not None
    assert loaded.context == []
