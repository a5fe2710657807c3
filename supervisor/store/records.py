"""The records exchanged between the session engine and the durable store.

This module is the store <-> engine contract. Both sides import from here;
changes are additive only and announced in the commit message.

Invariants:
- Event and transcript-batch sequences are per session, dense from 1, and
  assigned by the engine. The store keys writes by (session, sequence), so a
  re-commit of the same ``StepWrite`` is a no-op.
- ``StepWrite`` is everything one engine step changes; the store commits it in
  ONE transaction ("commit before visible": the engine publishes a step's events
  only after ``Store.commit`` returned).
- ``CheckpointState`` is small and replaced whole each step; it never holds the
  context (the context lives in transcript batches and rewrite snapshots), so a
  step costs writes proportional to what it added.
- All payloads are JSON-compatible dicts/lists (str keys, str/int/float/bool/None).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Generic, NewType, TypeVar

SessionId = NewType("SessionId", str)
TurnId = NewType("TurnId", str)
SubmissionId = NewType("SubmissionId", str)

T = TypeVar("T")

SESSION_ACTIVE = "active"
SESSION_CLOSED = "closed"
SESSION_STATUSES = (SESSION_ACTIVE, SESSION_CLOSED)

EXECUTION_OUTCOMES = ("running", "completed", "aborted", "failed")
TOOL_CALL_STATES = ("requested", "dispatched", "started", "ok", "failed", "unknown")


def _empty_usage() -> dict[str, int]:
    # Same shape as sandbox_worker.api.Usage (kept literal so this module has no imports
    # outside the standard library).
    return {
        "input": 0,
        "cached_input": 0,
        "cache_write_input": 0,
        "output": 0,
        "reasoning_output": 0,
        "total": 0,
    }


@dataclass(frozen=True, slots=True)
class SessionRecord:
    session_id: SessionId
    created_at: float  # wall-clock seconds, display only
    config: dict[str, Any]  # route name, workspace, approval policy, hooks, instructions, tenant
    parent_session_id: SessionId | None = None
    fork_sequence: int | None = None  # transcript batch sequence the fork was taken at
    status: str = SESSION_ACTIVE  # "active" | "closed"


@dataclass(frozen=True, slots=True)
class EventRecord:
    """One entry of the event journal; also what clients receive."""

    session_id: SessionId
    sequence: int  # per session, dense from 1, assigned by the engine
    type: str  # snake_case event type
    payload: dict[str, Any]
    submission_id: SubmissionId | None = None
    created_at: float = 0.0


@dataclass(frozen=True, slots=True)
class TranscriptBatch:
    """An append-only slice of the transcript."""

    session_id: SessionId
    sequence: int  # per session, dense from 1, assigned by the engine
    epoch: int  # the context epoch the items belong to
    items: list[dict[str, Any]]
    created_at: float = 0.0


@dataclass(frozen=True, slots=True)
class ContextRewrite:
    """Written only on compaction or rollback: the whole new context of an epoch."""

    epoch: int  # the new epoch
    items: list[dict[str, Any]]  # the whole new context of that epoch
    reasons: list[str]  # e.g. ["compaction"]
    at_batch: int  # the batch sequence from which later batches apply on top


@dataclass(slots=True)
class CheckpointState:
    """Small per-session state, replaced whole each step. Never holds the context."""

    context_epoch: int = 0
    compaction_count: int = 0
    last_rewrite: dict[str, Any] | None = None  # {"epoch", "reasons": [...], "at_batch"}
    total_usage: dict[str, int] = field(default_factory=_empty_usage)
    last_usage: dict[str, int] | None = None
    pending_approval: dict[str, Any] | None = None  # {"id","turn_id","calls":[...],"reason"}
    # {"call_id","name","arguments","state": requested|dispatched|started|ok|failed|unknown,
    #  "attempt", ...}
    pending_tool_calls: list[dict[str, Any]] = field(default_factory=list)
    queued_input: list[dict[str, Any]] = field(default_factory=list)  # ops during a turn
    # {"turn_id","submission_id","phase","model_steps","started_at",...}
    active_turn: dict[str, Any] | None = None
    approved_for_session: list[str] = field(default_factory=list)
    route: str | None = None
    next_event_sequence: int = 1
    next_batch_sequence: int = 1
    cache_breakpoint: int | None = None  # index in context of the prompt-cache breakpoint
    # A3S: the logical checkpoint under export; cleared when the run completes
    export_loop_checkpoint: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CheckpointState:
        """Build from a dict; unknown keys (from a newer writer) are kept in ``extra``."""
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        unknown = {k: v for k, v in d.items() if k not in known}
        state = cls(**kwargs)
        if unknown:
            state.extra = {**state.extra, **unknown}
        return state


@dataclass(frozen=True, slots=True)
class ExecutionRecord:
    """One per turn; upserted by (session_id, turn_id)."""

    session_id: SessionId
    turn_id: TurnId
    outcome: str  # "running" | "completed" | "aborted" | "failed"
    model_calls: int
    tool_calls: int
    failed_tool_calls: int
    usage: dict[str, int]
    started_at: float
    ended_at: float | None = None
    elapsed_s: float | None = None
    sandbox_tier: str | None = None
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class StepWrite:
    """Everything one engine step changes, committed in ONE transaction."""

    session_id: SessionId
    events: list[EventRecord] = field(default_factory=list)
    append_batch: TranscriptBatch | None = None
    rewrite: ContextRewrite | None = None
    state: CheckpointState | None = None
    execution: ExecutionRecord | None = None


@dataclass(frozen=True, slots=True)
class LoadedSession:
    record: SessionRecord
    state: CheckpointState
    context: list[dict[str, Any]]  # current epoch: rewrite items + the batches after it
    last_event_sequence: int
    last_batch_sequence: int


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    items: list[T]
    next_cursor: int | str | None  # None when there is no more
