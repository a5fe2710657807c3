"""Pin the public surface of ``supervisor.store`` and ``supervisor.export``."""

from __future__ import annotations

import inspect

import supervisor.store as store_pkg
from supervisor.store import Store
from supervisor.store.pg.store import PgStore


def test_store_exports() -> None:
    assert sorted(store_pkg.__all__) == sorted([
        "REDACTED", "SCHEMA_VERSION", "SECRET_KEYS", "CheckpointState", "ContextRewrite",
        "EventRecord", "ExecutionRecord", "InvalidRequest", "LeaseLost", "Limits",
        "LoadedSession", "Page",
        "RecordTooLarge", "SchemaMismatch", "SchemaTooNew", "SequenceConflict", "SessionExists",
        "SessionId", "SessionNotFound", "SessionRecord", "SessionStore", "StepWrite", "Store",
        "StoreBusy", "StoreClosed", "StoreCorrupt", "StoreError", "StoreFull",
        "StoreUnavailable", "SubmissionId", "TranscriptBatch", "TurnId",
        "scan_db_bytes",
    ])
    for name in store_pkg.__all__:
        assert hasattr(store_pkg, name), name


def _shape(fn: object) -> str:
    """A signature without annotations: names, defaults, and ``*`` before keyword-only."""
    out: list[str] = []
    star = False
    for p in inspect.signature(fn).parameters.values():  # type: ignore[arg-type]
        if p.kind is p.KEYWORD_ONLY and not star:
            out.append("*")
            star = True
        out.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return "(" + ", ".join(out) + ")"


def test_store_methods_match_the_engine_contract() -> None:
    expected = {
        "open": "(path, *, synchronous='NORMAL', busy_deadline_s=5.0, limits=None, "
                "max_group_ops=256, max_pending_ops=65536, max_db_pages=None)",
        "close": "(self)",
        "create_session": "(self, record, first=None)",
        "commit": "(self, step)",
        "commit_many": "(self, steps)",
        "load": "(self, session_id)",
        "get_session": "(self, session_id)",
        "active_sessions": "(self)",
        "set_status": "(self, session_id, status)",
        "list_sessions": "(self, *, after=None, limit=100)",
        "transcript_page": "(self, session_id, *, before_sequence=None, max_batches=50)",
        "events_page": "(self, session_id, *, after_sequence=0, limit=500)",
        "executions_page": "(self, session_id, *, before=None, limit=50)",
        "replay_events": "(self, session_id, *, max_events=100000)",
        "fork": "(self, session_id, *, at_sequence, new_session_id)",
        "context_at": "(self, session_id, *, at_batch, epoch=None)",
    }
    for name, shape in expected.items():
        fn = getattr(Store, name)
        assert _shape(fn) == shape, name
        assert inspect.iscoroutinefunction(fn), name
        if name != "open":  # PgStore.open takes a URL and no SQLite settings
            assert _shape(getattr(PgStore, name)) == shape, f"PgStore.{name}"
            assert inspect.iscoroutinefunction(getattr(PgStore, name)), name


def test_export_exports() -> None:
    import supervisor.export as export_pkg

    assert sorted(export_pkg.__all__) == sorted([
        "SCHEMA", "VERSION", "BindingMismatch", "CheckpointInvalid", "DirectorySink",
        "ExportError", "ExportSink", "HttpSink", "SinkError", "build_checkpoint",
        "canonical_bytes", "capability_binding", "digest", "export_to_sinks", "file_name",
        "find_run", "import_checkpoint", "load_loop_checkpoint", "loop_reference", "verify",
    ])
    for name in export_pkg.__all__:
        assert hasattr(export_pkg, name), name
    assert _shape(export_pkg.build_checkpoint) == (
        "(*, session_id, run_id, turn, messages, usage, binding, tool_rounds, execution, "
        "events, epoch, at_batch)")
    assert _shape(export_pkg.import_checkpoint) == (
        "(store, doc, *, expected_binding=None, new_session_id=None, config=None)")
