"""Durable session store: SQLite (WAL) via aiosqlite, the only writer of session state.

See docs/storage.md. The engine uses ``Store`` and the records of
``supervisor.store.records``; errors are ``supervisor.store.errors`` types.
"""

from supervisor.store.codec import REDACTED, SECRET_KEYS, Limits
from supervisor.store.errors import (
    InvalidRequest,
    RecordTooLarge,
    SchemaTooNew,
    SequenceConflict,
    SessionExists,
    SessionNotFound,
    StoreBusy,
    StoreClosed,
    StoreCorrupt,
    StoreError,
    StoreFull,
)
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
    "Limits",
    "LoadedSession",
    "Page",
    "RecordTooLarge",
    "SchemaTooNew",
    "SequenceConflict",
    "SessionExists",
    "SessionId",
    "SessionNotFound",
    "SessionRecord",
    "StepWrite",
    "Store",
    "StoreBusy",
    "StoreClosed",
    "StoreCorrupt",
    "StoreError",
    "StoreFull",
    "SubmissionId",
    "TranscriptBatch",
    "TurnId",
    "scan_db_bytes",
]
