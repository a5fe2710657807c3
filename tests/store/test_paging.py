"""Paging (transcript, events, executions, sessions), replay and forks."""

from __future__ import annotations

import pytest

from supervisor.store import (
    InvalidRequest,
    SessionExists,
    SessionId,
    SessionNotFound,
    Store,
    SubmissionId,
)
from tests.store.steps import Session, execution, new_record, tool_round


async def _session_with_rounds(store: Store, name: str, rounds: int) -> Session:
    s = Session(name)
    await store.create_session(new_record(name))
    for n in range(1, rounds + 1):
        await store.commit(s.step(tool_round(n), events=[("turn_started", {"n": n}),
                                                         ("turn_complete", {"n": n})]))
    return s


async def test_transcript_pages_walk_back_to_the_start(store: Store) -> None:
    s = await _session_with_rounds(store, "s1", 23)
    seen: list[int] = []
    cursor: int | None = None
    pages = 0
    while True:
        page = await store.transcript_page(s.id, before_sequence=cursor, max_batches=5)
        pages += 1
        sequences = [b.sequence for b in page.items]
        assert sequences == sorted(sequences)
        assert len(sequences) <= 5
        seen = sequences + seen
        if page.next_cursor is None:
            break
        assert page.next_cursor == sequences[0]
        cursor = int(page.next_cursor)
    assert seen == list(range(1, 24))
    assert pages == 5
    assert (await store.transcript_page(s.id, max_batches=5)).items[-1].items == tool_round(23)


async def test_events_pages_and_replay(store: Store) -> None:
    s = await _session_with_rounds(store, "s1", 30)
    page = await store.events_page(s.id, after_sequence=0, limit=25)
    assert [e.sequence for e in page.items] == list(range(1, 26))
    assert page.next_cursor == 25
    page = await store.events_page(s.id, after_sequence=25, limit=100)
    assert [e.sequence for e in page.items] == list(range(26, 61))
    assert page.next_cursor is None
    replay = await store.replay_events(s.id)
    assert [e.sequence for e in replay] == list(range(1, 61))
    assert replay[0].type == "turn_started"
    assert replay[0].payload == {"n": 1}


async def test_compaction_marker_survives_replay(store: Store) -> None:
    s = await _session_with_rounds(store, "s1", 2)
    await store.commit(s.step(
        rewrite=([{"type": "compaction", "summary": "earlier work"}], ["compaction"]),
        events=[("context_compacted", {"epoch": 1, "reasons": ["compaction"]})],
    ))
    await store.commit(s.step(tool_round(3), events=[("turn_complete", {"n": 3})]))
    replay = await store.replay_events(s.id)
    assert [e.type for e in replay].count("context_compacted") == 1
    assert replay[-1].type == "turn_complete"
    loaded = await store.load(s.id)
    assert loaded is not None
    assert loaded.state.context_epoch == 1
    assert loaded.state.compaction_count == 1
    assert loaded.state.last_rewrite is not None
    assert loaded.state.last_rewrite["reasons"] == ["compaction"]


async def test_replay_is_bounded(store: Store) -> None:
    s = await _session_with_rounds(store, "s1", 6)
    with pytest.raises(Exception, match="more than 5 events"):
        await store.replay_events(s.id, max_events=5)


async def test_execution_pages_newest_first(store: Store) -> None:
    s = Session("s1")
    await store.create_session(new_record("s1"))
    for t in range(1, 8):
        await store.commit(s.step(execution=execution("s1", f"t{t}", "running")))
        await store.commit(s.step(execution=execution("s1", f"t{t}", "completed",
                                                      tool_calls=t)))
    page = await store.executions_page(s.id, limit=3)
    assert [e.turn_id for e in page.items] == ["t7", "t6", "t5"]
    assert all(e.outcome == "completed" for e in page.items)
    assert isinstance(page.next_cursor, str)
    page2 = await store.executions_page(s.id, before=page.next_cursor, limit=3)
    assert [e.turn_id for e in page2.items] == ["t4", "t3", "t2"]
    page3 = await store.executions_page(s.id, before=str(page2.next_cursor), limit=3)
    assert [e.turn_id for e in page3.items] == ["t1"]
    assert page3.next_cursor is None
    with pytest.raises(InvalidRequest):
        await store.executions_page(s.id, before="not-a-cursor")


async def test_session_list_pages(store: Store) -> None:
    names = [f"sess-{i:03d}" for i in range(12)]
    for name in reversed(names):
        await store.create_session(new_record(name))
    got: list[str] = []
    after: str | None = None
    while True:
        page = await store.list_sessions(after=after, limit=5)
        got += [r.session_id for r in page.items]
        if page.next_cursor is None:
            break
        after = str(page.next_cursor)
    assert got == names


@pytest.mark.parametrize("bad", [0, -1, 100_000])
async def test_page_sizes_are_bounded(store: Store, bad: int) -> None:
    await store.create_session(new_record("s1"))
    with pytest.raises(InvalidRequest):
        await store.transcript_page(SessionId("s1"), max_batches=bad)
    with pytest.raises(InvalidRequest):
        await store.events_page(SessionId("s1"), limit=bad)
    with pytest.raises(InvalidRequest):
        await store.list_sessions(limit=bad)


async def test_fork_copies_the_context_at_a_batch(store: Store) -> None:
    s = await _session_with_rounds(store, "parent", 3)
    summary = [{"type": "compaction", "summary": "rounds 1-3"}]
    await store.commit(s.step(rewrite=(summary, ["compaction"])))
    for n in (4, 5):
        await store.commit(s.step(tool_round(n)))
    # At batch 2: before the compaction, the raw rounds.
    early = await store.fork(s.id, at_sequence=2, new_session_id=SessionId("early"))
    assert early.parent_session_id == "parent"
    assert early.fork_sequence == 2
    loaded = await store.load(SessionId("early"))
    assert loaded is not None
    assert loaded.context == tool_round(1) + tool_round(2)
    assert loaded.state.context_epoch == 0
    assert loaded.state.next_batch_sequence == 1
    assert loaded.last_batch_sequence == 0
    assert loaded.state.route == "main"
    # At batch 4: the compaction summary plus round 4.
    late = await store.fork(s.id, at_sequence=4, new_session_id=SessionId("late"))
    loaded = await store.load(SessionId("late"))
    assert loaded is not None
    assert late.fork_sequence == 4
    assert loaded.context == summary + tool_round(4)
    # The fork runs on by itself; the parent is untouched.
    f = Session("late")
    await store.commit(f.step(tool_round(40), events=[("forked_turn", {})]))
    loaded = await store.load(SessionId("late"))
    assert loaded is not None
    assert loaded.context == summary + tool_round(4) + tool_round(40)
    parent = await store.load(s.id)
    assert parent is not None
    assert parent.context == summary + tool_round(4) + tool_round(5)
    # An identical retry returns the same fork; a different one is refused.
    again = await store.fork(s.id, at_sequence=4, new_session_id=SessionId("late"))
    assert again.session_id == "late"
    assert again.fork_sequence == 4
    with pytest.raises(SessionExists):
        await store.fork(s.id, at_sequence=3, new_session_id=SessionId("late"))
    with pytest.raises(InvalidRequest):
        await store.fork(s.id, at_sequence=99, new_session_id=SessionId("x"))
    with pytest.raises(SessionNotFound):
        await store.fork(SessionId("nobody"), at_sequence=0, new_session_id=SessionId("y"))


async def test_context_at_a_batch_and_epoch(store: Store) -> None:
    s = await _session_with_rounds(store, "s1", 2)
    summary = [{"type": "compaction", "summary": "1-2"}]
    await store.commit(s.step(rewrite=(summary, ["compaction"])))  # epoch 1 at batch 2
    await store.commit(s.step(tool_round(3)))
    assert await store.context_at(s.id, at_batch=1) == tool_round(1)
    assert await store.context_at(s.id, at_batch=2, epoch=0) == tool_round(1) + tool_round(2)
    # The rewrite taken after batch 2 is not part of "right after batch 2".
    assert await store.context_at(s.id, at_batch=2) == tool_round(1) + tool_round(2)
    assert await store.context_at(s.id, at_batch=3) == summary + tool_round(3)
    assert await store.context_at(s.id, at_batch=3, epoch=1) == summary + tool_round(3)
    assert await store.context_at(SessionId("nobody"), at_batch=0) is None
    with pytest.raises(InvalidRequest):
        await store.context_at(s.id, at_batch=9)
    with pytest.raises(InvalidRequest):
        await store.context_at(s.id, at_batch=3, epoch=7)


async def test_replay_equals_the_committed_records_exactly(store: Store) -> None:
    s = Session("s1")
    await store.create_session(new_record("s1"))
    committed = []
    for n in range(1, 6):
        step = s.step(tool_round(n), events=[("tool_call_end", {"n": n, "ok": True})])
        step = type(step)(step.session_id, [type(e)(e.session_id, e.sequence, e.type, e.payload,
                                                    SubmissionId(f"sub-{n}"), 1000.5 + n)
                                            for e in step.events],
                          step.append_batch, step.rewrite, step.state, step.execution)
        await store.commit(step)
        committed += step.events
    assert await store.replay_events(s.id) == committed
