"""The turn as a pure state machine: ``step(state, event, now) -> (state, actions)``.

No I/O, no awaits, no clock of its own (``now`` is wall-clock seconds, given).
The state is frozen records whose phase and call-state fields are the Enums of
``phases.py``, moved only through ``advance_phase`` / ``advance_call`` (an
illegal move raises ``IllegalTransition``). Actions are data for a driver to
perform, in order; results come back as events.

The state is the checkpoint: ``TurnState.to_checkpoint`` gives exactly the
``active_turn``, ``pending_tool_calls`` and ``pending_approval`` fields of
``CheckpointState`` and ``TurnState.from_checkpoint`` reads them back, so there
is no second copy of a counter to keep in step. Every step that changes the
state emits one ``Commit`` carrying the new state, before any action that
shows or starts anything (commit before visible, commit before dispatch).

States (``TurnState.turn.phase``)::

    STARTING -Begin-> PREPARING -Prepared-> MODEL_CALL -ModelReplied(no calls)-> STOPPING
                         |  ^                  |   ^ ModelFailed(retryable, attempts left)
             CompactionDue  | CompactionDone   |   +--------+
                         v  |                  | ModelReplied(calls)
                       COMPACTING              v
                                    TOOLS <-> AWAITING_APPROVAL
                       (all calls ended: Export, next step: PREPARING)
    STOPPING -StopDone(continue)-> PREPARING;  STOPPING -StopDone-> COMPLETED
    COMPACTING -CompactionDone(failed; ``retries``: the model call's rule)-> COMPACTING
    any live phase -Interrupt / TurnTimedOut / ModelFailed(final) / Abort-> ABORTED | FAILED

Tool call: ``requested -> dispatched -> started -> ok | failed | unknown``.

Invariants (``tests/engine/test_machine.py`` checks each with a Hypothesis
``RuleBasedStateMachine``):
- A turn ends exactly once: one ``Commit`` carries ``turn_complete`` or
  ``turn_aborted``; after it every event is ignored (no action).
- No call is dispatched twice unless the model asked twice: a ``CallTool`` for a
  call id follows its ``Commit`` as ``dispatched``; a second one only for an
  idempotent tool after a lost worker (or a restart), up to
  ``Limits.idempotent_tool_attempts``.
- A lost call (worker lost, or in flight across a restart) ends ``unknown``
  unless it is idempotent and attempts are left.
- Every ``Publish`` follows the ``Commit`` of the same events.
- ``resume(from_checkpoint(to_checkpoint(s)))`` restarts exactly the work that
  was in flight in ``s`` (the model step, the approval, the tool calls as
  above): nothing the machine knows lives outside the checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, TypeAlias

from broker.protocol import Failure, FailureKind
from supervisor.engine.phases import CallState, TurnPhase, advance_call, advance_phase

MIN_REQUEST_BUDGET_S = 0.05  # a request with less left is not sent: the turn's limit ends it


class Verdict(StrEnum):
    """What the approval policy, the hooks or the user decided for one call."""

    ALLOW = "allow"
    DENY = "deny"
    ASK = "ask"
    MISSING = "missing"  # a tool the session does not offer
    BAD = "bad"  # arguments that are not a JSON object, or too large


class Ending(StrEnum):
    COMPLETED = "completed"
    INTERRUPTED = "interrupted"
    REJECTED = "rejected"
    FAILED = "failed"


_ENDING_PHASE = {Ending.COMPLETED: TurnPhase.COMPLETED, Ending.INTERRUPTED: TurnPhase.ABORTED,
                 Ending.REJECTED: TurnPhase.ABORTED, Ending.FAILED: TurnPhase.FAILED}


@dataclass(frozen=True, slots=True)
class Limits:
    """The ``EngineConfig`` numbers the machine decides with."""

    max_model_steps: int = 256
    max_turn_s: float = 3600.0
    model_attempts: int = 3
    idempotent_tool_attempts: int = 3
    stop_continuations: int = 1
    model_call_budget_s: float = 300.0
    tool_call_budget_s: float = 600.0


# ---------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class PendingCall:
    """One tool call of the current round, as persisted in
    ``CheckpointState.pending_tool_calls``."""

    call_id: str
    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    state: CallState = CallState.REQUESTED
    attempt: int = 0  # dispatches so far
    verdict: Verdict | None = None
    reason: str | None = None
    idempotent: bool = False
    outcome: str | None = None

    def moved(self, target: CallState, **changes: Any) -> PendingCall:
        return replace(self, state=advance_call(self.state, target), **changes)

    @property
    def in_flight(self) -> bool:
        return self.state in (CallState.DISPATCHED, CallState.STARTED)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"call_id": self.call_id, "name": self.name,
                             "arguments": dict(self.arguments), "state": str(self.state),
                             "attempt": self.attempt,
                             "verdict": None if self.verdict is None else str(self.verdict),
                             "reason": self.reason, "idempotent": self.idempotent}
        if self.outcome is not None:
            d["outcome"] = self.outcome
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PendingCall:
        verdict = d.get("verdict")
        return cls(str(d["call_id"]), str(d["name"]), dict(d.get("arguments") or {}),
                   CallState(d["state"]), int(d.get("attempt", 0)),
                   None if verdict is None else Verdict(verdict), d.get("reason"),
                   bool(d.get("idempotent", False)), d.get("outcome"))


@dataclass(frozen=True, slots=True)
class Approval:
    """One open ``exec_approval_request`` for a batch of calls."""

    approval_id: str
    call_ids: tuple[str, ...]
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ActiveTurn:
    """The turn's own record, as persisted in ``CheckpointState.active_turn``."""

    turn_id: str
    submission_id: str | None = None
    kind: str = "turn"  # "turn" | "compact"
    phase: TurnPhase = TurnPhase.STARTING
    model_steps: int = 0
    model_calls: int = 0
    attempt: int = 0  # attempt of the current model step
    tool_calls: int = 0
    failed_tool_calls: int = 0
    continuations: int = 0
    started_at: float = 0.0  # wall clock: max_turn_s counts across restarts
    first_sequence: int = 1
    tool_rounds: tuple[tuple[str, ...], ...] = ()

    def moved(self, target: TurnPhase, **changes: Any) -> ActiveTurn:
        return replace(self, phase=advance_phase(self.phase, target), **changes)

    def to_json(self) -> dict[str, Any]:
        return {"turn_id": self.turn_id, "submission_id": self.submission_id,
                "kind": self.kind, "phase": str(self.phase), "model_steps": self.model_steps,
                "model_calls": self.model_calls, "attempt": self.attempt,
                "tool_calls": self.tool_calls, "failed_tool_calls": self.failed_tool_calls,
                "continuations": self.continuations, "started_at": self.started_at,
                "first_sequence": self.first_sequence,
                "tool_rounds": [list(r) for r in self.tool_rounds]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ActiveTurn:
        return cls(str(d["turn_id"]), d.get("submission_id"), str(d.get("kind", "turn")),
                   TurnPhase(d["phase"]), int(d.get("model_steps", 0)),
                   int(d.get("model_calls", 0)), int(d.get("attempt", 0)),
                   int(d.get("tool_calls", 0)), int(d.get("failed_tool_calls", 0)),
                   int(d.get("continuations", 0)), float(d.get("started_at", 0.0)),
                   int(d.get("first_sequence", 1)),
                   tuple(tuple(str(c) for c in r) for r in d.get("tool_rounds", [])))


@dataclass(frozen=True, slots=True)
class TurnState:
    """Everything the machine knows about one turn; all of it is persisted."""

    turn: ActiveTurn
    calls: tuple[PendingCall, ...] = ()
    approval: Approval | None = None

    @property
    def ended(self) -> bool:
        return self.turn.phase.terminal

    def call(self, call_id: str) -> PendingCall | None:
        return next((c for c in self.calls if c.call_id == call_id), None)

    def with_call(self, new: PendingCall) -> TurnState:
        return replace(self, calls=tuple(new if c.call_id == new.call_id else c
                                         for c in self.calls))

    def to_checkpoint(self) -> dict[str, Any]:
        """The ``CheckpointState`` fields this turn owns (an ended turn owns none)."""
        if self.ended:
            return {"active_turn": None, "pending_tool_calls": [], "pending_approval": None}
        approval = None
        if self.approval is not None:
            approval = {"id": self.approval.approval_id, "turn_id": self.turn.turn_id,
                        "call_ids": list(self.approval.call_ids),
                        "reason": self.approval.reason}
        return {"active_turn": self.turn.to_json(),
                "pending_tool_calls": [c.to_json() for c in self.calls],
                "pending_approval": approval}

    @classmethod
    def from_checkpoint(cls, d: Mapping[str, Any]) -> TurnState | None:
        at = d.get("active_turn")
        if at is None:
            return None
        ap = d.get("pending_approval")
        approval = None
        if ap is not None:
            ids = ap.get("call_ids") or [c["call_id"] for c in ap.get("calls", [])]
            approval = Approval(str(ap["id"]), tuple(str(i) for i in ids),
                                str(ap.get("reason", "")))
        return cls(ActiveTurn.from_json(at),
                   tuple(PendingCall.from_json(c) for c in d.get("pending_tool_calls", [])),
                   approval)


# ----------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class Begin:
    """The admitted input (or a compact op) starts the turn."""


@dataclass(frozen=True, slots=True)
class Prepared:
    """pre_model / model_request hooks ran: the model step may be sent."""


@dataclass(frozen=True, slots=True)
class CompactionDue:
    pass


@dataclass(frozen=True, slots=True)
class CompactionDone:
    ok: bool = True
    failure: Failure | None = None


@dataclass(frozen=True, slots=True)
class CallSpec:
    """A function call the model asked for, with the driver's verdict on it
    (pre_tool hooks, the approval policy and permission hooks already ran)."""

    call_id: str
    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    verdict: Verdict = Verdict.ALLOW
    reason: str | None = None
    idempotent: bool = False


@dataclass(frozen=True, slots=True)
class ModelReplied:
    calls: tuple[CallSpec, ...] = ()
    text: str = ""


@dataclass(frozen=True, slots=True)
class ModelFailed:
    failure: Failure


@dataclass(frozen=True, slots=True)
class ToolStarted:
    call_id: str


@dataclass(frozen=True, slots=True)
class ToolReplied:
    call_id: str
    is_error: bool = False
    outcome: str = "ok"


@dataclass(frozen=True, slots=True)
class ToolFailed:
    call_id: str
    failure: Failure


@dataclass(frozen=True, slots=True)
class ApprovalAnswered:
    approval_id: str
    decision: str  # approved | approved_for_session | denied | abort | timed_out


@dataclass(frozen=True, slots=True)
class StopDone:
    continue_with: bool = False


@dataclass(frozen=True, slots=True)
class Interrupt:
    pass


@dataclass(frozen=True, slots=True)
class TurnTimedOut:
    pass


@dataclass(frozen=True, slots=True)
class Abort:
    """The turn fails for a reason the driver met (a hook, the usage observer)."""

    failure: Failure


Event: TypeAlias = (Begin | Prepared | CompactionDue | CompactionDone | ModelReplied
                    | ModelFailed | ToolStarted | ToolReplied | ToolFailed | ApprovalAnswered
                    | StopDone | Interrupt | TurnTimedOut | Abort)


# ---------------------------------------------------------------- actions

EventSpec: TypeAlias = tuple[str, Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class Commit:
    """Persist ``state`` (``to_checkpoint``) and ``events`` in one store transaction."""

    state: TurnState
    events: tuple[EventSpec, ...] = ()


@dataclass(frozen=True, slots=True)
class Publish:
    """Show committed events to subscribers."""

    events: tuple[EventSpec, ...]


@dataclass(frozen=True, slots=True)
class RunHook:
    hook: str  # pre_model | stop | turn_end


@dataclass(frozen=True, slots=True)
class CallModel:
    step: int
    attempt: int
    budget_s: float


@dataclass(frozen=True, slots=True)
class Compact:
    budget_s: float


@dataclass(frozen=True, slots=True)
class CallTool:
    call_id: str
    attempt: int
    budget_s: float


@dataclass(frozen=True, slots=True)
class AskApproval:
    approval_id: str
    call_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Cancel:
    """Cancel what is in flight: the model step and/or these tool calls."""

    model: bool
    call_ids: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Export:
    round: int
    call_ids: tuple[str, ...]


Action: TypeAlias = (Commit | Publish | RunHook | CallModel | Compact | CallTool | AskApproval
                     | Cancel | Export)


# ------------------------------------------------------------------ step


def start(turn_id: str, submission_id: str | None, now: float, *, kind: str = "turn",
          first_sequence: int = 1) -> TurnState:
    """A new turn, not yet committed (``Begin`` commits it)."""
    return TurnState(ActiveTurn(turn_id, submission_id, kind, started_at=now,
                                first_sequence=first_sequence))


def retries(failure: Failure, attempt: int, attempts: int) -> bool:
    """The one retry rule of a model call and of a compaction call: again after a
    lost worker or a retryable failure, while ``attempts`` are left."""
    return (failure.retryable or failure.kind == FailureKind.WORKER_LOST) \
        and attempt < attempts


def reruns_lost(idempotent: bool, attempt: int, attempts: int) -> bool:
    """The one rule for a tool call whose worker (or supervisor) was lost while
    it ran: dispatched again only if the tool is idempotent and fewer than
    ``attempts`` dispatches were made; else it ends ``unknown``."""
    return idempotent and attempt < attempts


def budget_s(state: TurnState, cap_s: float, limits: Limits, now: float) -> float:
    """A request's budget: what is left of the turn's ``max_turn_s`` (counted from
    its stored start), at most ``cap_s``."""
    left = limits.max_turn_s - max(0.0, now - state.turn.started_at)
    return max(MIN_REQUEST_BUDGET_S, min(cap_s, left))


class _Out:
    """The actions of one step, with the commit-then-publish pairing."""

    def __init__(self) -> None:
        self.actions: list[Action] = []

    def commit(self, state: TurnState, *events: EventSpec) -> None:
        self.actions.append(Commit(state, tuple(events)))
        if events:
            self.actions.append(Publish(tuple(events)))

    def add(self, action: Action) -> None:
        self.actions.append(action)


def step(state: TurnState, event: Event, limits: Limits,
         now: float) -> tuple[TurnState, tuple[Action, ...]]:
    """Apply one event; return the new state and the actions to perform in order."""
    if state.ended:
        return state, ()  # late answers after the end change nothing
    out = _Out()
    new = _step(state, event, limits, now, out)
    return new, tuple(out.actions)


def resume(state: TurnState, limits: Limits, now: float) -> tuple[TurnState, tuple[Action, ...]]:
    """Restart the work that was in flight when the process holding ``state``
    died: the model step is re-issued (a new step), the approval is asked again,
    in-flight tool calls are re-dispatched if idempotent and attempts are left,
    else they end ``unknown``."""
    if state.ended:
        return state, ()
    out = _Out()
    t = state.turn
    tid = t.turn_id
    if now - t.started_at >= limits.max_turn_s:
        return _end(state, Ending.FAILED, out, Failure("turn_limit",
                    f"the turn ran longer than {limits.max_turn_s:g}s")), tuple(out.actions)
    if t.phase in (TurnPhase.STARTING, TurnPhase.PREPARING, TurnPhase.MODEL_CALL,
                   TurnPhase.COMPACTING):
        if t.phase is TurnPhase.MODEL_CALL:
            out.commit(state, ("model_step_completed",
                               {"turn_id": tid, "step": t.model_steps,
                                "outcome": "interrupted"}))
        if t.phase is not TurnPhase.PREPARING:
            state = replace(state, turn=t.moved(TurnPhase.PREPARING, attempt=0))
            out.commit(state)
        out.add(RunHook("pre_model"))
    elif t.phase is TurnPhase.STOPPING:
        out.add(RunHook("stop"))
    elif t.phase is TurnPhase.AWAITING_APPROVAL and state.approval is not None:
        out.add(AskApproval(state.approval.approval_id, state.approval.call_ids))
    else:  # TOOLS
        for c in state.calls:
            if c.in_flight:
                state = _lost(state, c, limits, now, out,
                              "the supervisor restarted while this call was running")
            elif c.state is CallState.REQUESTED and c.verdict is Verdict.ALLOW:
                state = _dispatch(state, c, limits, now, out)
        state = _maybe_round_done(state, limits, now, out)
    return state, tuple(out.actions)


def _step(s: TurnState, e: Event, limits: Limits, now: float, out: _Out) -> TurnState:
    t = s.turn
    tid = t.turn_id
    match e:
        case Interrupt():
            return _end(s, Ending.INTERRUPTED, out, None)
        case TurnTimedOut():
            return _end(s, Ending.FAILED, out, Failure(
                "turn_limit", f"the turn ran longer than {limits.max_turn_s:g}s"))
        case Abort(failure):
            return _end(s, Ending.FAILED, out, failure)
        case Begin():
            if t.phase is not TurnPhase.STARTING:
                return s
            s = replace(s, turn=t.moved(TurnPhase.PREPARING))
            out.commit(s, ("turn_started", {"turn_id": tid}))
            out.add(RunHook("pre_model"))
            return s
        case CompactionDue():
            if t.phase is not TurnPhase.PREPARING:
                return s
            s = replace(s, turn=t.moved(TurnPhase.COMPACTING, attempt=1))
            out.commit(s, ("frontend_render", {"turn_id": tid, "state": "pending"}))
            out.add(Compact(budget_s(s, limits.model_call_budget_s, limits, now)))
            return s
        case CompactionDone(ok, failure):
            if t.phase is not TurnPhase.COMPACTING:
                return s
            if not ok:
                failure = failure or Failure("model_failed", "compaction failed")
                if retries(failure, t.attempt, limits.model_attempts):
                    # the same rule and budget as a model call; the notice stays open
                    s = replace(s, turn=replace(t, attempt=t.attempt + 1))
                    out.commit(s, ("warning", {"turn_id": tid, "compaction_retry": {
                        "attempt": t.attempt, "error": failure.as_data()}}))
                    out.add(Compact(budget_s(s, limits.model_call_budget_s, limits, now)))
                    return s
                return _end(s, Ending.FAILED, out, failure)
            s = replace(s, turn=t.moved(TurnPhase.PREPARING, attempt=0))
            out.commit(s, ("context_compacted", {"turn_id": tid}))
            out.add(RunHook("pre_model"))
            return s
        case Prepared():
            if t.phase is not TurnPhase.PREPARING:
                return s  # a stale hook result: nothing to prepare
            if t.model_steps >= limits.max_model_steps:
                return _end(s, Ending.FAILED, out, Failure(
                    "turn_limit",
                    f"the turn reached its limit of {limits.max_model_steps} model steps"))
            return _call_model(s, t.model_steps + 1, 1, limits, now, out)
        case ModelReplied() | ModelFailed():
            return _on_model(s, e, limits, now, out)
        case ToolStarted() | ToolReplied() | ToolFailed():
            return _on_tool(s, e, limits, now, out)
        case ApprovalAnswered(approval_id, decision):
            return _answered(s, approval_id, decision, limits, now, out)
        case StopDone(continue_with):
            if t.phase is not TurnPhase.STOPPING:
                return s
            if continue_with and t.continuations < limits.stop_continuations:
                s = replace(s, turn=t.moved(TurnPhase.PREPARING,
                                            continuations=t.continuations + 1))
                out.commit(s)
                out.add(RunHook("pre_model"))
                return s
            return _end(s, Ending.COMPLETED, out, None)
    raise TypeError(f"not a turn event: {e!r}")  # pragma: no cover (the union is closed)


def _on_model(s: TurnState, e: ModelReplied | ModelFailed, limits: Limits, now: float,
              out: _Out) -> TurnState:
    """The answer to the model step in flight (anything else is stale)."""
    t = s.turn
    tid = t.turn_id
    match e:
        case ModelReplied(calls, text):
            if t.phase is not TurnPhase.MODEL_CALL:
                return s
            return _model_replied(s, calls, text, limits, now, out)
        case ModelFailed(failure):
            if t.phase is not TurnPhase.MODEL_CALL:
                return s
            again = retries(failure, t.attempt, limits.model_attempts)
            done = ("model_step_completed", {"turn_id": tid, "step": t.model_steps,
                                             "attempt": t.attempt,
                                             "outcome": "retrying" if again else "failed",
                                             "error": failure.as_data()})
            if not again:
                out.commit(s, done)
                return _end(s, Ending.FAILED, out, Failure(
                    "model_failed", f"model call failed: {failure.kind}: {failure.message}",
                    failure.retryable))
            out.commit(s, done)
            return _call_model(s, t.model_steps, t.attempt + 1, limits, now, out)
    return s


def _on_tool(s: TurnState, e: ToolStarted | ToolReplied | ToolFailed, limits: Limits,
             now: float, out: _Out) -> TurnState:
    """News of a dispatched call (a call no longer in flight: stale, ignored)."""
    match e:
        case ToolStarted(call_id):
            c = s.call(call_id)
            if c is None or c.state is not CallState.DISPATCHED:
                return s
            s = s.with_call(c.moved(CallState.STARTED))
            out.commit(s)
            return s
        case ToolReplied(call_id, is_error, outcome):
            c = s.call(call_id)
            if c is None or not c.in_flight:
                return s  # a reply for a call already ended (lost, interrupted): stale
            return _tool_ended(s, c, CallState.FAILED if is_error else CallState.OK, outcome,
                               limits, now, out)
        case ToolFailed(call_id, failure):
            c = s.call(call_id)
            if c is None or not c.in_flight:
                return s
            if failure.kind == FailureKind.WORKER_LOST:
                return _lost(s, c, limits, now, out, failure.message, round_done=True)
            return _tool_ended(s, c, CallState.FAILED, "failed", limits, now, out,
                               error=failure)
    return s


def _call_model(s: TurnState, step_no: int, attempt: int, limits: Limits, now: float,
                out: _Out) -> TurnState:
    t = s.turn
    s = replace(s, turn=t.moved(TurnPhase.MODEL_CALL, model_steps=step_no, attempt=attempt,
                                model_calls=t.model_calls + (attempt == 1)))
    out.commit(s, ("model_step_started", {"turn_id": t.turn_id, "step": step_no,
                                          "attempt": attempt}))
    out.add(CallModel(step_no, attempt, budget_s(s, limits.model_call_budget_s, limits, now)))
    return s


def _model_replied(s: TurnState, calls: tuple[CallSpec, ...], text: str, limits: Limits,
                   now: float, out: _Out) -> TurnState:
    t = s.turn
    tid = t.turn_id
    completed = ("model_step_completed", {"turn_id": tid, "step": t.model_steps,
                                          "outcome": "completed"})
    message = (("agent_message", {"turn_id": tid, "text": text}),) if text else ()
    if not calls:
        s = replace(s, turn=t.moved(TurnPhase.STOPPING, attempt=0))
        out.commit(s, *message, completed)
        out.add(RunHook("stop"))
        return s
    pcs = tuple(PendingCall(c.call_id, c.name, dict(c.arguments), CallState.REQUESTED, 0,
                            c.verdict, c.reason, c.idempotent) for c in calls)
    ask = tuple(c.call_id for c in pcs if c.verdict is Verdict.ASK)
    if ask:
        approval = Approval(f"approval_{tid}_{t.model_steps}", ask)
        s = replace(s, turn=t.moved(TurnPhase.AWAITING_APPROVAL, attempt=0), calls=pcs,
                    approval=approval)
        out.commit(s, *message, completed,
                   ("exec_approval_request", {"id": approval.approval_id, "turn_id": tid,
                                              "call_ids": list(ask)}))
        out.add(AskApproval(approval.approval_id, ask))
        return s
    s = replace(s, turn=t.moved(TurnPhase.TOOLS, attempt=0), calls=pcs)
    out.commit(s, *message, completed)
    return _run_decided(s, limits, now, out)


def _run_decided(s: TurnState, limits: Limits, now: float, out: _Out) -> TurnState:
    """End the calls that may not run; dispatch the allowed ones."""
    for c in s.calls:
        if c.state is not CallState.REQUESTED:
            continue
        if c.verdict is Verdict.ALLOW:
            s = _dispatch(s, c, limits, now, out)
        elif c.verdict is not Verdict.ASK:
            s = _tool_ended(s, c, CallState.FAILED, str(c.verdict), limits, now, out,
                            round_done=False)
    return _maybe_round_done(s, limits, now, out)


def _dispatch(s: TurnState, c: PendingCall, limits: Limits, now: float,
              out: _Out) -> TurnState:
    attempt = c.attempt + 1
    c2 = c.moved(CallState.DISPATCHED, attempt=attempt)
    s = s.with_call(c2)
    out.commit(s, ("tool_call_begin", {"turn_id": s.turn.turn_id, "call_id": c.call_id,
                                       "name": c.name, "attempt": attempt}))
    out.add(CallTool(c.call_id, attempt, budget_s(s, limits.tool_call_budget_s, limits, now)))
    return s


def _lost(s: TurnState, c: PendingCall, limits: Limits, now: float, out: _Out, why: str,
          *, round_done: bool = False) -> TurnState:
    """A call whose worker (or supervisor) was lost mid-call: re-dispatched only
    if idempotent with attempts left, else it ends ``unknown``."""
    if reruns_lost(c.idempotent, c.attempt, limits.idempotent_tool_attempts):
        s = _dispatch(s, c, limits, now, out)
    else:
        s = _tool_ended(s, c, CallState.UNKNOWN, "unknown", limits, now, out,
                        error=Failure(FailureKind.WORKER_LOST, why, True), round_done=False)
    return _maybe_round_done(s, limits, now, out) if round_done else s


def _tool_ended(s: TurnState, c: PendingCall, target: CallState, outcome: str, limits: Limits,
                now: float, out: _Out, *, error: Failure | None = None,
                round_done: bool = True) -> TurnState:
    t = s.turn
    s = replace(s.with_call(c.moved(target, outcome=outcome)),
                turn=replace(t, tool_calls=t.tool_calls + 1,
                             failed_tool_calls=t.failed_tool_calls + (target is not CallState.OK)))
    payload: dict[str, Any] = {"turn_id": t.turn_id, "call_id": c.call_id,
                               "state": str(target), "outcome": outcome}
    if error is not None:
        payload["error"] = error.as_data()
    out.commit(s, ("tool_call_end", payload))
    return _maybe_round_done(s, limits, now, out) if round_done else s


def _maybe_round_done(s: TurnState, limits: Limits, now: float, out: _Out) -> TurnState:
    """When every call of the round has ended: clear them, export, next step."""
    t = s.turn
    if t.phase is not TurnPhase.TOOLS or not all(c.state.terminal for c in s.calls):
        return s
    ids = tuple(c.call_id for c in s.calls)
    s = TurnState(t.moved(TurnPhase.PREPARING, tool_rounds=(*t.tool_rounds, ids)))
    out.commit(s)
    out.add(Export(len(s.turn.tool_rounds), ids))
    out.add(RunHook("pre_model"))
    return s


def _answered(s: TurnState, approval_id: str, decision: str, limits: Limits, now: float,
              out: _Out) -> TurnState:
    t = s.turn
    if s.approval is None or s.approval.approval_id != approval_id \
            or t.phase is not TurnPhase.AWAITING_APPROVAL:
        out.commit(s, ("warning", {"message": "approval response targeted a stale request"}))
        return s
    if decision == "abort":
        return _end(s, Ending.REJECTED, out, None)
    allow = decision in ("approved", "approved_for_session")
    asked = set(s.approval.call_ids)
    calls = tuple(replace(c, verdict=Verdict.ALLOW if allow else Verdict.DENY,
                          reason=f"{decision} by the user")
                  if c.call_id in asked else c for c in s.calls)
    s = TurnState(t.moved(TurnPhase.TOOLS), calls, None)
    events: tuple[EventSpec, ...] = ()
    if decision == "timed_out":
        events = (("warning", {"message": "approval timed out", "approval_id": approval_id}),)
    out.commit(s, *events)
    return _run_decided(s, limits, now, out)


def _end(s: TurnState, how: Ending, out: _Out, failure: Failure | None) -> TurnState:
    """The turn's one ending: cancel what is in flight, close open calls, commit."""
    t = s.turn
    in_flight = tuple(c.call_id for c in s.calls if c.in_flight)
    model = t.phase in (TurnPhase.MODEL_CALL, TurnPhase.COMPACTING)
    if in_flight or model:
        out.add(Cancel(model, in_flight))
    events: list[EventSpec] = []
    if failure is not None:
        events.append(("error", failure.as_data()))
    if how is Ending.COMPLETED:
        events.append(("turn_complete", {"turn_id": t.turn_id}))
    else:
        events.append(("turn_aborted", {"turn_id": t.turn_id, "reason": str(how)}))
    ended = TurnState(t.moved(_ENDING_PHASE[how], attempt=0))
    out.commit(ended, *events)
    out.add(RunHook("turn_end"))
    return ended
