"""Durable session store, the only writer of session state: SQLite (WAL) via aiosqlite
by default (``Store``), PostgreSQL via psycopg 3 with ``[store] url`` (``pg.PgStore``).

See docs/storage.md. The engine uses the ``SessionStore`` interface and the records of
``supervisor.store.records``; errors are ``supervisor.store.errors`` types;
``opening.open_store`` chooses the implementation.
"""

from supervisor.store.codec import REDACTED, SECRET_KEYS, Limits
from supervisor.store.errors import (
    InvalidRequest,
    LeaseLost,
    RecordTooLarge,
    SchemaMismatch,
    SchemaTooNew,
    SequenceConflict,
    SessionExists,
    SessionNotFound,
    StoreBusy,
    StoreClosed,
    StoreCorrupt,
    StoreError,
    StoreFull,
    StoreUnavailable,
)
from supervisor.store.port import SessionStore
from supervisor.store.records import (
    CheckpointState,
    ContextRewrite,
    EventRecord,
    ExecutionRecord,
    LoadedSession,
    Page,
    SessionId,
    SessionRecord,
    StepWrite,
    SubmissionId,
    TranscriptBatch,
    TurnId,
)
from supervisor.store.scan import scan_db_bytes
from supervisor.store.schema import SCHEMA_VERSION
from supervisor.store.store import Store

__all__ = [
    "REDACTED",
    "SCHEMA_VERSION",
    "SECRET_KEYS",
    "CheckpointState",
    "ContextRewrite",
    "EventRecord",
    "ExecutionRecord",
    "InvalidRequest",
    "LeaseLost",
    "Limits",
    "LoadedSession",
    "Page",
    "RecordTooLarge",
    "SchemaMismatch",
    "SchemaTooNew",
    "SequenceConflict",
    "SessionExists",
    "SessionId",
    "SessionNotFound",
    "SessionRecord",
    "SessionStore",
    "StepWrite",
    "Store",
    "StoreBusy",
    "StoreClosed",
    "StoreCorrupt",
    "StoreError",
    "StoreFull",
    "StoreUnavailable",
    "SubmissionId",
    "TranscriptBatch",
    "TurnId",
    "scan_db_bytes",
]
