"""The one store interface the supervisor uses (``SessionStore``), and what both
implementations share.

Two implementations satisfy it: ``supervisor.store.store.Store`` (SQLite, the embedded
default) and ``supervisor.store.pg.store.PgStore`` (PostgreSQL, chosen by ``[store] url``
in corral.toml). ``supervisor.store.opening.open_store`` picks one. The engine, the
facade, exports and the CLI are typed against ``SessionStore`` only, so mypy checks that
both keep the same surface.

Invariants every implementation keeps (tests/store run against both):
- Commit before visible: ``commit`` returns only once the transaction holding the step
  committed.
- Idempotent by key: a re-commit of an identical step (session, sequence) is a no-op;
  different content under a stored key, or a gap, is ``SequenceConflict``.
- Group commit: concurrent sessions' steps share one transaction (``groups_committed``
  counts transactions, ``ops_committed`` operations).
- Bounded growth: pending writes, pages, records and replays are bounded (``Limits``,
  ``reader.MAX_PAGE_*``); the state row is replaced, never appended.
"""

from __future__ import annotations

from typing import Any, Protocol

from supervisor.store.codec import Limits
from supervisor.store.errors import RecordTooLarge
from supervisor.store.reader import MAX_PAGE_EVENTS
from supervisor.store.records import (
    EventRecord,
    ExecutionRecord,
    LoadedSession,
    Page,
    SessionId,
    SessionRecord,
    StepWrite,
    TranscriptBatch,
)


class SessionStore(Protocol):
    """The durable session store, whatever holds it."""

    limits: Limits

    @property
    def groups_committed(self) -> int:
        """Transactions committed (a group each), for tests and benchmarks."""
        ...

    @property
    def ops_committed(self) -> int:
        """Operations committed in those transactions."""
        ...

    @property
    def where(self) -> str:
        """Where the store lives, for messages and logs (a path, or a URL without its
        password)."""
        ...

    async def close(self) -> None: ...

    # writes
    async def create_session(self, record: SessionRecord,
                             first: StepWrite | None = None) -> None: ...

    async def commit(self, step: StepWrite) -> None: ...

    async def commit_many(self, steps: list[StepWrite]) -> None: ...

    async def set_status(self, session_id: SessionId, status: str) -> None: ...

    async def delete_session(self, session_id: SessionId) -> None: ...

    async def fork(self, session_id: SessionId, *, at_sequence: int,
                   new_session_id: SessionId) -> SessionRecord: ...

    # reads
    async def load(self, session_id: SessionId) -> LoadedSession | None: ...

    async def context_at(self, session_id: SessionId, *, at_batch: int,
                         epoch: int | None = None) -> list[dict[str, Any]] | None: ...

    async def get_session(self, session_id: SessionId) -> SessionRecord | None: ...

    async def active_sessions(self) -> list[SessionId]: ...

    async def list_sessions(self, *, after: str | None = None,
                            limit: int = 100) -> Page[SessionRecord]: ...

    async def transcript_page(self, session_id: SessionId, *,
                              before_sequence: int | None = None,
                              max_batches: int = 50) -> Page[TranscriptBatch]: ...

    async def events_page(self, session_id: SessionId, *, after_sequence: int = 0,
                          limit: int = 500) -> Page[EventRecord]: ...

    async def executions_page(self, session_id: SessionId, *, before: str | None = None,
                              limit: int = 50) -> Page[ExecutionRecord]: ...

    async def replay_events(self, session_id: SessionId, *,
                            max_events: int = 100_000) -> list[EventRecord]: ...


async def replay_events(store: SessionStore, session_id: SessionId,
                        max_events: int) -> list[EventRecord]:
    """The session's whole event journal in order, read page by page; above
    ``max_events`` raises ``RecordTooLarge`` (use ``events_page``)."""
    events: list[EventRecord] = []
    after = 0
    while True:
        page = await store.events_page(session_id, after_sequence=after,
                                       limit=MAX_PAGE_EVENTS)
        events.extend(page.items)
        if len(events) > max_events:
            raise RecordTooLarge(
                f"session {session_id!r} has more than {max_events} events; page them"
            )
        if page.next_cursor is None:
            return events
        after = int(page.next_cursor)
