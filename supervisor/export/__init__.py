"""Portable checkpoints: build at a tool boundary, verify, import, and export to sinks.

See docs/storage.md ("Portable export") and ``supervisor.export.errors`` for the
exception tree.
"""

from supervisor.export.canonical import canonical_bytes, digest
from supervisor.export.checkpoint import (
    SCHEMA,
    VERSION,
    build_checkpoint,
    capability_binding,
    find_run,
    verify,
)
from supervisor.export.errors import BindingMismatch, CheckpointInvalid, ExportError, SinkError
from supervisor.export.resume import import_checkpoint, load_loop_checkpoint, loop_reference
from supervisor.export.sinks import (
    DirectorySink,
    ExportSink,
    HttpSink,
    export_to_sinks,
    file_name,
)

__all__ = [
    "SCHEMA",
    "VERSION",
    "BindingMismatch",
    "CheckpointInvalid",
    "DirectorySink",
    "ExportError",
    "ExportSink",
    "HttpSink",
    "SinkError",
    "build_checkpoint",
    "canonical_bytes",
    "capability_binding",
    "digest",
    "export_to_sinks",
    "file_name",
    "find_run",
    "import_checkpoint",
    "load_loop_checkpoint",
    "loop_reference",
    "verify",
]
