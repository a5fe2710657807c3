"""Typed session events: one frozen dataclass per event type, parsed from the
supervisor's event records (``supervisor/engine/events.py`` has the types and
the durability rule; ``docs/engine.md`` their payloads).

Every event keeps its envelope (``type``, ``session_id``, ``sequence``,
``submission_id``, ``created_at``) and its raw ``payload``; the typed fields
are read from the payload with safe defaults, so an event from a newer
supervisor with extra fields still parses. A type this module does not know
parses as the base ``Event``.

Invariants:
- ``parse_event`` never raises on a record shaped as the wire sends it; a
  field of the wrong type reads as its default.
- ``sequence > 0`` iff the event is durable (deltas are live-only, ``0``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final


def _s(p: Mapping[str, Any], key: str, default: str = "") -> str:
    v = p.get(key)
    return v if isinstance(v, str) else default


def _i(p: Mapping[str, Any], key: str, default: int = 0) -> int:
    v = p.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else default


def _b(p: Mapping[str, Any], key: str) -> bool:
    return p.get(key) is True


def _d(p: Mapping[str, Any], key: str) -> dict[str, Any]:
    v = p.get(key)
    return dict(v) if isinstance(v, Mapping) else {}


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Any session event. ``payload`` is the record's payload as sent."""

    type: str
    session_id: str
    sequence: int
    submission_id: str | None = None
    created_at: float = 0.0
    payload: Mapping[str, Any] = field(default_factory=dict)

    @property
    def turn_id(self) -> str | None:
        value = self.payload.get("turn_id")
        return value if isinstance(value, str) else None

    @property
    def durable(self) -> bool:
        return self.sequence > 0


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionConfigured(Event):
    route: str = ""
    workspace: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnStarted(Event):
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class UserMessage(Event):
    text: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelStepStarted(Event):
    step: int = 0
    attempt: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelStepCompleted(Event):
    step: int = 0
    outcome: str = ""  # completed | failed | interrupted | retrying


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentMessageDelta(Event):
    text: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentReasoningDelta(Event):
    text: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentMessage(Event):
    text: str = ""
    partial: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallBegin(Event):
    call_id: str = ""
    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    attempt: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallOutputDelta(Event):
    call_id: str = ""
    stream: str = "stdout"
    text: str = ""


@dataclass(frozen=True, slots=True)
class CallError:
    """Why a tool call failed or ended unknown: the failure sent as data."""

    kind: str
    message: str
    retryable: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallEnd(Event):
    """A tool call's end. ``state``: ok | failed | unknown; ``isolation``: what
    it really ran under (``tier: "client"`` for a client tool)."""

    call_id: str = ""
    name: str = ""
    output: str = ""
    is_error: bool = False
    outcome: str = ""
    state: str = ""
    isolation: dict[str, Any] = field(default_factory=dict)
    error: CallError | None = None
    error_kind: str | None = None  # a result's own kind, e.g. client_tool_raised

    @property
    def tier(self) -> str | None:
        value = self.isolation.get("tier")
        return value if isinstance(value, str) else None


@dataclass(frozen=True, slots=True)
class ApprovalCall:
    call_id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecApprovalRequest(Event):
    """Calls that wait for an answer: ``Session.approve(event.approval_id, ...)``."""

    approval_id: str = ""
    calls: tuple[ApprovalCall, ...] = ()
    reason: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenCount(Event):
    last: dict[str, Any] = field(default_factory=dict)
    total: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class WarningEvent(Event):
    message: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorEvent(Event):
    kind: str = ""
    message: str = ""
    retryable: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class ContextCompacted(Event):
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class FrontendRender(Event):
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnComplete(Event):
    last_agent_message: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnAborted(Event):
    reason: str = ""  # interrupted | rejected | failed
    message: str = ""


TERMINAL: Final = (TurnComplete, TurnAborted)


def _fields(etype: str, p: Mapping[str, Any]) -> tuple[type[Event], dict[str, Any]]:
    if etype == "session_configured":
        return SessionConfigured, {"route": _s(p, "route"), "workspace": _s(p, "workspace")}
    if etype == "turn_started":
        return TurnStarted, {}
    if etype == "user_message":
        return UserMessage, {"text": _s(p, "text")}
    if etype == "model_step_started":
        return ModelStepStarted, {"step": _i(p, "step"), "attempt": _i(p, "attempt")}
    if etype == "model_step_completed":
        return ModelStepCompleted, {"step": _i(p, "step"), "outcome": _s(p, "outcome")}
    if etype == "agent_message_delta":
        return AgentMessageDelta, {"text": _s(p, "text")}
    if etype == "agent_reasoning_delta":
        return AgentReasoningDelta, {"text": _s(p, "text")}
    if etype == "agent_message":
        return AgentMessage, {"text": _s(p, "text"), "partial": _b(p, "partial")}
    if etype == "tool_call_begin":
        return ToolCallBegin, {"call_id": _s(p, "call_id"), "name": _s(p, "name"),
                               "arguments": _d(p, "arguments"), "attempt": _i(p, "attempt")}
    if etype == "tool_call_output_delta":
        return ToolCallOutputDelta, {"call_id": _s(p, "call_id"),
                                     "stream": _s(p, "stream", "stdout"), "text": _s(p, "text")}
    if etype == "tool_call_end":
        err = _d(p, "error")
        return ToolCallEnd, {
            "call_id": _s(p, "call_id"), "name": _s(p, "name"), "output": _s(p, "output"),
            "is_error": _b(p, "is_error"), "outcome": _s(p, "outcome"),
            "state": _s(p, "state"), "isolation": _d(p, "isolation"),
            "error_kind": _s(p, "error_kind") or None,
            "error": CallError(_s(err, "kind"), _s(err, "message"), _b(err, "retryable"))
            if err else None}
    if etype == "exec_approval_request":
        calls = p.get("calls")
        return ExecApprovalRequest, {
            "approval_id": _s(p, "id"), "reason": _s(p, "reason"),
            "calls": tuple(ApprovalCall(_s(c, "call_id"), _s(c, "name"), _d(c, "arguments"))
                           for c in (calls if isinstance(calls, list) else [])
                           if isinstance(c, Mapping))}
    if etype == "token_count":
        return TokenCount, {"last": _d(p, "last"), "total": _d(p, "total")}
    if etype == "warning":
        return WarningEvent, {"message": _s(p, "message")}
    if etype == "error":
        return ErrorEvent, {"kind": _s(p, "kind"), "message": _s(p, "message"),
                            "retryable": _b(p, "retryable")}
    if etype == "context_compacted":
        return ContextCompacted, {}
    if etype == "frontend_render":
        return FrontendRender, {}
    if etype == "turn_complete":
        return TurnComplete, {"last_agent_message": _s(p, "last_agent_message")}
    if etype == "turn_aborted":
        return TurnAborted, {"reason": _s(p, "reason"), "message": _s(p, "message")}
    return Event, {}


def parse_event(record: Mapping[str, Any]) -> Event:
    """The typed event of one record as the supervisor sends it."""
    raw = record.get("payload")
    payload: dict[str, Any] = dict(raw) if isinstance(raw, Mapping) else {}
    etype = _s(record, "type", "unknown")
    cls, fields = _fields(etype, payload)
    sub = record.get("submission_id")
    created = record.get("created_at")
    return cls(type=etype, session_id=_s(record, "session_id"),
               sequence=_i(record, "sequence"),
               submission_id=sub if isinstance(sub, str) else None,
               created_at=float(created) if isinstance(created, int | float) else 0.0,
               payload=payload, **fields)
