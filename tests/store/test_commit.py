"""Commits on a real SQLite file: one transaction per step, idempotent re-commits,
dense sequences, group commit of concurrent sessions, context after rewrites."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from supervisor.store import (
    EventRecord,
    InvalidRequest,
    Limits,
    RecordTooLarge,
    SequenceConflict,
    SessionExists,
    SessionId,
    SessionNotFound,
    SessionStore,
    StepWrite,
    TranscriptBatch,
)
from tests.store.backends import open_backend, row_count, state_bytes, stored_bytes
from tests.store.steps import Session, execution, new_record, tool_round


async def test_commit_then_load_gives_context_state_and_sequences(store: SessionStore) -> None:
    s = Session("s1")
    await store.create_session(new_record("s1"))
    for n in range(1, 4):
        await store.commit(s.step(tool_round(n), events=[("turn_started", {"n": n}),
                                                         ("turn_complete", {"n": n})]))
    loaded = await store.load(s.id)
    assert loaded is not None
    assert loaded.context == tool_round(1) + tool_round(2) + tool_round(3)
    assert loaded.last_event_sequence == 6
    assert loaded.last_batch_sequence == 3
    assert loaded.state.next_event_sequence == 7
    assert loaded.state.next_batch_sequence == 4
    assert loaded.state.route == "main"
    assert loaded.record.config["route"] == "main"
    assert await store.load(SessionId("nope")) is None


async def test_recommit_of_same_step_is_a_noop(store: SessionStore) -> None:
    s = Session("s1")
    await store.create_session(new_record("s1"))
    step = s.step(tool_round(1), events=[("item_completed", {"i": 1})])
    await store.commit(step)
    await store.commit(step)
    await store.commit_many([step, step])
    # Re-creating the identical session is also a no-op.
    await store.create_session(store_record := new_record("s1"))
    del store_record
    loaded = await store.load(s.id)
    assert loaded is not None
    assert loaded.context == tool_round(1)
    assert [e.sequence for e in await store.replay_events(s.id)] == [1]
    assert row_count(store, "events") == 1
    assert row_count(store, "transcript_batches") == 1


async def test_cancelled_commit_followed_by_retry_commits_once(store: SessionStore) -> None:
    s = Session("s1")
    await store.create_session(new_record("s1"))
    for n in range(1, 21):
        step = s.step(tool_round(n), events=[("tool_call_end", {"n": n})])
        task = asyncio.create_task(store.commit(step))
        await asyncio.sleep(0)  # the step is queued (and may be on the writer thread)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await store.commit(step)  # the engine's retry after a cancelled await
    loaded = await store.load(s.id)
    assert loaded is not None
    assert loaded.last_batch_sequence == 20
    assert loaded.last_event_sequence == 20
    assert loaded.context == [i for n in range(1, 21) for i in tool_round(n)]
    assert [e.sequence for e in await store.replay_events(s.id)] == list(range(1, 21))


async def test_sequence_gap_and_different_content_are_conflicts(store: SessionStore) -> None:
    s = Session("s1")
    await store.create_session(new_record("s1"))
    await store.commit(s.step(tool_round(1), events=[("a", {"x": 1})]))
    gap = StepWrite(s.id, events=[EventRecord(s.id, 5, "a", {})])
    with pytest.raises(SequenceConflict, match="gap"):
        await store.commit(gap)
    changed = StepWrite(s.id, events=[EventRecord(s.id, 1, "a", {"x": 2})])
    with pytest.raises(SequenceConflict, match="different"):
        await store.commit(changed)
    # Nothing of the failed steps landed; the next good step still commits.
    await store.commit(s.step(tool_round(2), events=[("b", {})]))
    events = await store.replay_events(s.id)
    assert [(e.sequence, e.type, e.payload) for e in events] == [(1, "a", {"x": 1}), (2, "b", {})]


async def test_state_behind_the_journal_is_refused(store: SessionStore) -> None:
    s = Session("s1")
    await store.create_session(new_record("s1"))
    step = s.step(tool_round(1), events=[("a", {})])
    bad_state = step.state
    assert bad_state is not None
    bad_state.next_event_sequence = 1  # claims nothing was journaled
    with pytest.raises(SequenceConflict, match="state says"):
        await store.commit(step)
    loaded = await store.load(s.id)
    assert loaded is not None
    assert loaded.last_event_sequence == 0  # the whole step rolled back


async def test_late_recommit_of_older_step_does_not_roll_state_back(store: SessionStore) -> None:
    s = Session("s1")
    await store.create_session(new_record("s1"))
    first = s.step(tool_round(1), events=[("a", {})], extra={"mark": 1})
    second = s.step(tool_round(2), events=[("b", {})], extra={"mark": 2})
    await store.commit(first)
    await store.commit(second)
    await store.commit(first)
    loaded = await store.load(s.id)
    assert loaded is not None
    assert loaded.state.extra == {"mark": 2}
    assert loaded.state.next_batch_sequence == 3


async def test_execution_upsert_and_terminal_outcome_is_not_regressed(store: SessionStore) -> None:
    s = Session("s1")
    await store.create_session(new_record("s1"))
    running = execution("s1", "t1", "running")
    failed = execution("s1", "t1", "failed", reason="provider failure")
    await store.commit(s.step(execution=running))
    await store.commit(s.step(execution=failed))
    await store.commit(StepWrite(s.id, execution=running))  # a stale re-commit
    page = await store.executions_page(s.id, limit=10)
    assert [(e.turn_id, e.outcome, e.reason) for e in page.items] == [
        ("t1", "failed", "provider failure")
    ]


async def test_rewrite_replaces_context_and_later_batches_apply_on_top(store: SessionStore) -> None:
    s = Session("s1")
    await store.create_session(new_record("s1"))
    for n in range(1, 4):
        await store.commit(s.step(tool_round(n)))
    summary = [{"type": "compaction", "summary": "rounds 1-3 done"}]
    await store.commit(s.step(rewrite=(summary, ["compaction"]),
                              events=[("context_compacted", {"epoch": 1})]))
    await store.commit(s.step(tool_round(4)))
    loaded = await store.load(s.id)
    assert loaded is not None
    assert loaded.context == summary + tool_round(4)
    assert loaded.state.context_epoch == 1
    assert loaded.state.compaction_count == 1
    assert loaded.state.last_rewrite == {"epoch": 1, "reasons": ["compaction"], "at_batch": 3}
    # The transcript stays append-only: all four batches are still paged.
    page = await store.transcript_page(s.id, max_batches=10)
    assert [b.sequence for b in page.items] == [1, 2, 3, 4]
    assert [b.epoch for b in page.items] == [0, 0, 0, 1]


async def test_rewrite_and_batch_in_one_step(store: SessionStore) -> None:
    s = Session("s1")
    await store.create_session(new_record("s1"))
    await store.commit(s.step(tool_round(1)))
    summary = [{"type": "compaction", "summary": "s"}]
    await store.commit(s.step(tool_round(2), rewrite=(summary, ["compaction"])))
    loaded = await store.load(s.id)
    assert loaded is not None
    assert loaded.context == summary + tool_round(2)


async def test_concurrent_sessions_are_group_committed(store: SessionStore) -> None:
    sessions = [Session(f"s{i}") for i in range(16)]
    for s in sessions:
        await store.create_session(new_record(s.id))
    groups_before = store.groups_committed

    async def run(s: Session) -> None:
        for n in range(1, 11):
            await store.commit(s.step(tool_round(n), events=[("e", {"n": n})]))

    async with asyncio.TaskGroup() as tg:
        for s in sessions:
            tg.create_task(run(s))
    groups = store.groups_committed - groups_before
    assert groups < 160  # 160 steps shared fewer transactions
    for s in sessions:
        loaded = await store.load(s.id)
        assert loaded is not None
        assert loaded.last_batch_sequence == 10
        assert loaded.context == [i for n in range(1, 11) for i in tool_round(n)]


async def test_a_bad_step_fails_alone_within_its_group(store: SessionStore) -> None:
    good, other = Session("good"), Session("other")
    await store.create_session(new_record("good"))
    await store.create_session(new_record("other"))
    await store.commit(other.step(tool_round(1)))
    # Batch 1 of "other" again, with different items: a conflict, in the same group as
    # two good steps of another session.
    conflicting = StepWrite(other.id, append_batch=TranscriptBatch(other.id, 1, 0, tool_round(99)))
    results = await asyncio.gather(
        store.commit(good.step(tool_round(1))),
        store.commit(conflicting),
        store.commit(good.step(tool_round(2))),
        return_exceptions=True,
    )
    assert results[0] is None
    assert results[2] is None
    assert isinstance(results[1], SequenceConflict)
    loaded = await store.load(good.id)
    assert loaded is not None
    assert loaded.last_batch_sequence == 2
    loaded = await store.load(other.id)
    assert loaded is not None
    assert loaded.context == tool_round(1)


async def test_unknown_session_existing_session_and_bad_input(store: SessionStore) -> None:
    ghost = Session("ghost")
    with pytest.raises(SessionNotFound):
        await store.commit(ghost.step(tool_round(1)))
    await store.create_session(new_record("s1"))
    with pytest.raises(SessionExists):
        await store.create_session(new_record("s1", route="other"))
    with pytest.raises(InvalidRequest):
        await store.set_status(SessionId("s1"), "sleeping")
    with pytest.raises(InvalidRequest):
        await store.commit(StepWrite(SessionId("s1"), events=[
            EventRecord(SessionId("s1"), 1, "x", {"blob": b"bytes"})]))  # not JSON


async def test_status_and_active_sessions(store: SessionStore) -> None:
    for name in ("a", "b", "c"):
        await store.create_session(new_record(name))
    await store.set_status(SessionId("b"), "closed")
    assert await store.active_sessions() == ["a", "c"]
    record = await store.get_session(SessionId("b"))
    assert record is not None
    assert record.status == "closed"


async def test_data_survives_close_and_reopen(
    request: pytest.FixtureRequest, backend: str, tmp_path: Path
) -> None:
    s = Session("s1")
    store = await open_backend(request, backend, tmp_path)
    await store.create_session(new_record("s1"))
    await store.commit(s.step(tool_round(1), events=[("a", {})]))
    await store.close()
    store = await open_backend(request, backend, tmp_path, fresh=False)
    try:
        loaded = await store.load(s.id)
        assert loaded is not None
        assert loaded.context == tool_round(1)
        await store.commit(s.step(tool_round(2), events=[("b", {})]))
        assert (await store.load(s.id)).last_batch_sequence == 2  # type: ignore[union-attr]
    finally:
        await store.close()


async def test_oversize_item_and_state_are_refused_before_writing(
    request: pytest.FixtureRequest, backend: str, tmp_path: Path
) -> None:
    limits = Limits(max_item_bytes=4096, max_state_bytes=2048)
    store = await open_backend(request, backend, tmp_path, limits=limits)
    try:
        s = Session("s1")
        await store.create_session(new_record("s1"))
        big = [{"type": "function_call_output", "call_id": "c", "output": "x" * 5000}]
        with pytest.raises(RecordTooLarge, match=r"items\[0\]"):
            await store.commit(s.step(big))
        s2 = Session("s1")
        with pytest.raises(RecordTooLarge, match="checkpoint state"):
            await store.commit(s2.step(tool_round(1), extra={"blob": "y" * 4000}))
        loaded = await store.load(s.id)
        assert loaded is not None
        assert loaded.last_batch_sequence == 0
    finally:
        await store.close()


async def test_a_failed_create_does_not_leave_a_stale_session_mapping(store: SessionStore) -> None:
    # The first step is bad (its events start at 2): the session row is rolled back too.
    bad_first = StepWrite(SessionId("a"), events=[EventRecord(SessionId("a"), 2, "x", {})])
    with pytest.raises(SequenceConflict):
        await store.create_session(new_record("a"), bad_first)
    assert await store.get_session(SessionId("a")) is None
    # Another session may now get the row id "a" had; "a" must not write into it.
    await store.create_session(new_record("b"))
    await store.create_session(new_record("a"))
    a, b = Session("a"), Session("b")
    await store.commit(a.step(tool_round(1)))
    await store.commit(b.step(tool_round(2)))
    loaded_a, loaded_b = await store.load(a.id), await store.load(b.id)
    assert loaded_a is not None
    assert loaded_b is not None
    assert loaded_a.context == tool_round(1)
    assert loaded_b.context == tool_round(2)


async def test_close_drains_pending_commits(
    request: pytest.FixtureRequest, backend: str, tmp_path: Path
) -> None:
    store = await open_backend(request, backend, tmp_path)
    sessions = [Session(f"s{i}") for i in range(8)]
    for s in sessions:
        await store.create_session(new_record(s.id))
    commits = [asyncio.create_task(store.commit(s.step(tool_round(1)))) for s in sessions]
    await asyncio.sleep(0)
    await store.close()
    await asyncio.gather(*commits)
    store = await open_backend(request, backend, tmp_path, fresh=False)
    try:
        for s in sessions:
            loaded = await store.load(s.id)
            assert loaded is not None
            assert loaded.last_batch_sequence == 1
    finally:
        await store.close()


async def test_a_step_costs_what_it_added_not_the_whole_context(store: SessionStore) -> None:
    """Database growth per step stays flat as the session's context grows (page counts,
    not timings): a step writes its events, one batch and one small state row."""
    try:
        s = Session("s1")
        await store.create_session(new_record("s1"))
        sizes = [stored_bytes(store)]
        for n in range(1, 301):
            await store.commit(s.step(tool_round(n), events=[("tool_call_end", {"n": n})]))
            if n % 50 == 0:
                sizes.append(stored_bytes(store))
        first, last = sizes[1] - sizes[0], sizes[-1] - sizes[-2]
        assert last <= first * 1.3, sizes
        loaded = await store.load(s.id)
        assert loaded is not None
        assert len(loaded.context) == 4 * 300
    finally:
        await store.close()
    assert state_bytes(store) < 2000  # the state row holds no context
