"""Property test: random sequences of appends, rewrites, forks and re-commits against a
plain in-memory model of the transcript; the store's context, context_at, transcript
pages and replay must always agree with it."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor.store import SessionId, SessionStore, Store
from supervisor.store.pg.store import PgStore
from tests.store.backends import empty_pg
from tests.store.steps import Session, new_record

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 3)),
        st.tuples(st.just("rewrite"), st.integers(0, 2)),
        st.tuples(st.just("append_and_rewrite"), st.integers(1, 2)),
        st.tuples(st.just("recommit"), st.just(0)),
        st.tuples(st.just("fork"), st.integers(0, 1000)),
    ),
    min_size=1,
    max_size=25,
)


def _items(tag: str, n: int) -> list[dict[str, Any]]:
    return [{"type": "message", "role": "user", "content": [{"type": "input_text",
                                                             "text": f"{tag}-{i}"}]}
            for i in range(n)]


async def _run(ops: list[tuple[str, int]], opener: Callable[[], Awaitable[SessionStore]]) -> None:
    store = await opener()
    try:
        s = Session("m")
        await store.create_session(new_record("m"))
        context: list[dict[str, Any]] = []  # the model
        # The context right after each batch was appended.
        after_batch: dict[int, list[dict[str, Any]]] = {0: []}
        last_step = None
        forks = 0
        for i, (op, n) in enumerate(ops):
            if op == "append":
                last_step = s.step(_items(f"a{i}", n), events=[("e", {"i": i})])
                context = context + _items(f"a{i}", n)
            elif op == "rewrite":
                new = context[-n:] if n else []
                new = [{"type": "compaction", "summary": f"r{i}"}, *new]
                last_step = s.step(rewrite=(new, ["compaction"]),
                                   events=[("context_compacted", {"i": i})])
                context = new
            elif op == "append_and_rewrite":
                new = [{"type": "compaction", "summary": f"r{i}"}]
                last_step = s.step(_items(f"b{i}", n), rewrite=(new, ["compaction"]))
                context = new + _items(f"b{i}", n)
            elif op == "recommit":
                if last_step is not None:
                    await store.commit(last_step)
                continue
            else:
                last = s.state.next_batch_sequence - 1
                at = n % (last + 1)
                forks += 1
                fork_id = SessionId(f"f{forks}")
                await store.fork(s.id, at_sequence=at, new_session_id=fork_id)
                loaded = await store.load(fork_id)
                assert loaded is not None
                assert loaded.context == after_batch[at]
                continue
            await store.commit(last_step)
            if last_step.rewrite is not None and last_step.rewrite.at_batch == 0:
                # A rewrite taken before any batch is the base of "right after batch 0".
                after_batch[0] = list(last_step.rewrite.items)
            if last_step.append_batch is not None:
                # "Right after batch N": a rewrite-only step comes after its batch.
                after_batch[last_step.append_batch.sequence] = list(context)
            loaded = await store.load(s.id)
            assert loaded is not None
            assert loaded.context == context
            assert loaded.state.next_batch_sequence == loaded.last_batch_sequence + 1
        for batch, expected in after_batch.items():
            if batch:
                got = await store.context_at(s.id, at_batch=batch)
                assert got == expected, batch
        page = await store.transcript_page(s.id, max_batches=1000)
        assert [b.sequence for b in page.items] == list(range(1, len(page.items) + 1))
        replay = await store.replay_events(s.id)
        assert [e.sequence for e in replay] == list(range(1, len(replay) + 1))
        assert sum(e.type == "context_compacted" for e in replay) == sum(
            op == "rewrite" for op, _ in ops)
    finally:
        await store.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_store_agrees_with_a_plain_model(ops: list[tuple[str, int]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(_run(ops, lambda: Store.open(Path(tmp) / "model.db")))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_postgresql_store_agrees_with_a_plain_model(pg_database: str,
                                                    ops: list[tuple[str, int]]) -> None:
    empty_pg(pg_database)
    asyncio.run(_run(ops, lambda: PgStore.open(pg_database)))
