"""Lifecycles of a turn and of a tool call, as Enums whose illegal moves raise.

A turn is persisted at each transition (``CheckpointState.active_turn["phase"]``
and ``CheckpointState.pending_tool_calls[i]["state"]``), so a supervisor that
restarts knows exactly where each turn stood. Diagram::

    starting ──▶ preparing ──▶ model_call ──▶ tools ──▶ preparing (next step)
       │            │  ▲           │            │  ▲
       │            ▼  │           │            ▼  │
       │        compacting         │      awaiting_approval
       │                           ▼
       │                        stopping ──▶ completed
       └──────────────▶ (any live phase) ──▶ aborted | failed

Tool call::

    requested ──▶ dispatched ──▶ started ──▶ ok | failed | unknown
        │              │  ▲ (idempotent retry)      ▲
        └──────────────┴──┴─────────────────────────┘  (denied, missing, lost)

Invariants:
- ``advance`` is the only way to change a phase/state; an edge that is not in
  the tables below raises ``IllegalTransition`` (it is a bug, never input).
- Terminal phases and states have no outgoing edges.
"""

from __future__ import annotations

from enum import StrEnum

from supervisor.engine.errors import IllegalTransition


class TurnPhase(StrEnum):
    STARTING = "starting"  # hooks: session_start (queued), user_prompt_submit
    PREPARING = "preparing"  # compaction check, pre_model, model_request
    COMPACTING = "compacting"  # compaction call and its hooks
    MODEL_CALL = "model_call"  # a model request is in flight
    TOOLS = "tools"  # tool calls of one step are dispatched / running
    AWAITING_APPROVAL = "awaiting_approval"  # an exec_approval_request is open
    STOPPING = "stopping"  # stop hooks (may ask for one continuation)
    COMPLETED = "completed"
    ABORTED = "aborted"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL_PHASES


_TERMINAL_PHASES = frozenset({TurnPhase.COMPLETED, TurnPhase.ABORTED, TurnPhase.FAILED})
_PHASE_EDGES: dict[TurnPhase, frozenset[TurnPhase]] = {
    TurnPhase.STARTING: frozenset({TurnPhase.PREPARING, TurnPhase.COMPACTING} | _TERMINAL_PHASES),
    TurnPhase.PREPARING: frozenset(
        {TurnPhase.COMPACTING, TurnPhase.MODEL_CALL, TurnPhase.PREPARING} | _TERMINAL_PHASES
    ),
    TurnPhase.COMPACTING: frozenset({TurnPhase.PREPARING} | _TERMINAL_PHASES),
    TurnPhase.MODEL_CALL: frozenset(
        {TurnPhase.TOOLS, TurnPhase.AWAITING_APPROVAL, TurnPhase.STOPPING,
         TurnPhase.MODEL_CALL, TurnPhase.PREPARING} | _TERMINAL_PHASES
    ),
    TurnPhase.AWAITING_APPROVAL: frozenset({TurnPhase.TOOLS} | _TERMINAL_PHASES),
    TurnPhase.TOOLS: frozenset(
        {TurnPhase.PREPARING, TurnPhase.AWAITING_APPROVAL} | _TERMINAL_PHASES
    ),
    TurnPhase.STOPPING: frozenset({TurnPhase.PREPARING} | _TERMINAL_PHASES),
    TurnPhase.COMPLETED: frozenset(),
    TurnPhase.ABORTED: frozenset(),
    TurnPhase.FAILED: frozenset(),
}


def advance_phase(current: TurnPhase, target: TurnPhase) -> TurnPhase:
    """Return ``target`` if ``current -> target`` is an edge, else raise."""
    if target not in _PHASE_EDGES[current]:
        raise IllegalTransition(f"turn phase {current} cannot move to {target}")
    return target


class CallState(StrEnum):
    REQUESTED = "requested"  # the model asked for it; durable before anything runs
    DISPATCHED = "dispatched"  # sent to the tool service
    STARTED = "started"  # the worker reported output (it is running)
    OK = "ok"
    FAILED = "failed"  # tool error, denial, missing tool, infrastructure failure
    UNKNOWN = "unknown"  # the worker was lost mid-call: the effect is unknown

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL_CALL_STATES


_TERMINAL_CALL_STATES = frozenset({CallState.OK, CallState.FAILED, CallState.UNKNOWN})
_CALL_EDGES: dict[CallState, frozenset[CallState]] = {
    CallState.REQUESTED: frozenset({CallState.DISPATCHED, CallState.FAILED, CallState.UNKNOWN}),
    # dispatched -> dispatched is an idempotent retry on another worker
    CallState.DISPATCHED: frozenset(
        {CallState.DISPATCHED, CallState.STARTED} | _TERMINAL_CALL_STATES
    ),
    CallState.STARTED: frozenset({CallState.DISPATCHED} | _TERMINAL_CALL_STATES),
    CallState.OK: frozenset(),
    CallState.FAILED: frozenset(),
    CallState.UNKNOWN: frozenset(),
}


def advance_call(current: CallState, target: CallState) -> CallState:
    """Return ``target`` if ``current -> target`` is an edge, else raise."""
    if target not in _CALL_EDGES[current]:
        raise IllegalTransition(f"tool call state {current} cannot move to {target}")
    return target
