"""Event types, the envelope, and which events are durable.

Every event a client sees is an ``EventRecord`` (``supervisor.store.records``):
``session_id``, ``sequence``, ``submission_id`` (None for system events),
``type`` and ``payload``.

Durability rule (the replay/live equality the chaos harness checks):
- Every type in ``DURABLE_TYPES`` is journaled: it gets the session's next
  ``sequence`` (dense from 1), is committed with its step, and only then
  published ("commit before visible"). Replay from the store therefore equals
  the durable events seen live, with no gap and no duplicate.
- The high-volume deltas in ``LIVE_ONLY_TYPES`` (``agent_message_delta``,
  ``agent_reasoning_delta``, ``tool_call_output_delta``) are published live and
  never journaled. They carry ``sequence == 0`` and
  ``payload["after_sequence"]`` = the last durable sequence published before
  them (their position), plus ``payload["delta_index"]`` counting up within one
  model step or tool call. Their content is always summed up by a durable event
  (``agent_message`` / ``model_step_completed`` / ``tool_call_end``).
- ``store_status`` is live-only too, with the same envelope: a notice that the
  store is unreachable and the session's work paused, or back (``engine/outage.py``).
  It carries no content of the session, so showing it never shows anything that
  is not committed.

Invariants:
- ``sequence > 0`` iff the event is durable.
- A payload is JSON-compatible and bounded (``clip`` caps long text).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Final

from broker.protocol import Failure
from supervisor.store.records import EventRecord, SessionId, SubmissionId

SESSION_CONFIGURED: Final = "session_configured"
TURN_STARTED: Final = "turn_started"
USER_MESSAGE: Final = "user_message"
MODEL_STEP_STARTED: Final = "model_step_started"
AGENT_MESSAGE_DELTA: Final = "agent_message_delta"
AGENT_REASONING_DELTA: Final = "agent_reasoning_delta"
AGENT_MESSAGE: Final = "agent_message"
MODEL_STEP_COMPLETED: Final = "model_step_completed"
TOOL_CALL_BEGIN: Final = "tool_call_begin"
TOOL_CALL_OUTPUT_DELTA: Final = "tool_call_output_delta"
TOOL_CALL_END: Final = "tool_call_end"
EXEC_APPROVAL_REQUEST: Final = "exec_approval_request"
TOKEN_COUNT: Final = "token_count"
WARNING: Final = "warning"
ERROR: Final = "error"
CONTEXT_COMPACTED: Final = "context_compacted"
FRONTEND_RENDER: Final = "frontend_render"
TURN_COMPLETE: Final = "turn_complete"
TURN_ABORTED: Final = "turn_aborted"
# A notice of the session's state, not of its content: the store became unreachable
# (the session's work is paused) or is back (engine/outage.py). Live only.
STORE_STATUS: Final = "store_status"

LIVE_ONLY_TYPES: Final = frozenset({AGENT_MESSAGE_DELTA, AGENT_REASONING_DELTA,
                                    TOOL_CALL_OUTPUT_DELTA, STORE_STATUS})
DURABLE_TYPES: Final = frozenset({
    SESSION_CONFIGURED, TURN_STARTED, USER_MESSAGE, MODEL_STEP_STARTED, AGENT_MESSAGE,
    MODEL_STEP_COMPLETED, TOOL_CALL_BEGIN, TOOL_CALL_END, EXEC_APPROVAL_REQUEST, TOKEN_COUNT,
    WARNING, ERROR, CONTEXT_COMPACTED, FRONTEND_RENDER, TURN_COMPLETE, TURN_ABORTED,
})
ALL_TYPES: Final = DURABLE_TYPES | LIVE_ONLY_TYPES
TERMINAL_TURN_TYPES: Final = frozenset({TURN_COMPLETE, TURN_ABORTED})

# model_step_completed outcomes and turn_aborted reasons
STEP_COMPLETED: Final = "completed"
STEP_FAILED: Final = "failed"
STEP_INTERRUPTED: Final = "interrupted"
STEP_RETRYING: Final = "retrying"
ABORT_INTERRUPTED: Final = "interrupted"
ABORT_REJECTED: Final = "rejected"
ABORT_FAILED: Final = "failed"

# Warnings whose exact text clients and tests rely on.
STALE_APPROVAL: Final = "approval response targeted a stale request"
STALE_INTERRUPT: Final = "interrupt targeted a stale turn"
NO_ACTIVE_TURN: Final = "no active turn to interrupt"

# Compaction notice (frontend_render, capability "compaction").
COMPACTION_CAPABILITY: Final = "compaction"
COMPACTING_TITLE: Final = "Context compacting"
COMPACTED_TITLE: Final = "Context compacted"
COMPACTION_FAILED_TITLE: Final = "Context compaction failed"
COMPACTION_CANCELLED_TITLE: Final = "Context compaction cancelled"

MAX_PAYLOAD_TEXT: Final = 64 * 1024


def clip(text: str, limit: int = MAX_PAYLOAD_TEXT) -> str:
    """Cap a text for an event payload, saying that it was cut."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[... {len(text) - limit} characters cut]"


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


def durable(
    session_id: SessionId, sequence: int, type_: str, payload: dict[str, Any],
    submission_id: SubmissionId | None,
) -> EventRecord:
    if type_ not in DURABLE_TYPES:
        raise ValueError(f"{type_} is not a durable event type")
    return EventRecord(session_id, sequence, type_, payload, submission_id, time.time())


def live(
    session_id: SessionId, after_sequence: int, delta_index: int, type_: str,
    payload: dict[str, Any], submission_id: SubmissionId | None,
) -> EventRecord:
    if type_ not in LIVE_ONLY_TYPES:
        raise ValueError(f"{type_} is not a live-only event type")
    body = {**payload, "after_sequence": after_sequence, "delta_index": delta_index}
    return EventRecord(session_id, 0, type_, body, submission_id, time.time())


def warning(message: str, **extra: Any) -> dict[str, Any]:
    return {"message": message, **extra}


def error(failure: Failure) -> dict[str, Any]:
    """An ``error`` payload: the failure's kind, message (clipped) and retryability;
    never an exception class name or a traceback."""
    return {"kind": failure.kind, "message": clip(failure.message, 4096),
            "retryable": failure.retryable}


def render_block(block_id: str, title: str, *, complete: bool, text: str = "") -> dict[str, Any]:
    return {
        "capability": COMPACTION_CAPABILITY,
        "block": {"id": block_id, "title": title,
                  "state": "complete" if complete else "pending", "text": text},
    }


def message_text(item: dict[str, Any]) -> str:
    """The text of a message item (its string content, or its parts' texts)."""
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return "".join(p.get("text", "") for p in content
                   if isinstance(p, dict) and isinstance(p.get("text"), str))
