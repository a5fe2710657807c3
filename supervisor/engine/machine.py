"""The turn as a pure state machine: ``step(state, event, now) -> (state, actions)``.

No I/O, no awaits, no clock of its own (``now`` is wall-clock seconds, given).
The state is frozen records whose phase and call-state fields are the Enums of
``phases.py``, moved only through ``advance_phase`` / ``advance_call`` (an
illegal move raises ``IllegalTransition``). Actions are data for a driver to
perform, in order; results come back as events (``turn.Turn.feed``). The
machine decides (the next phase, which calls run, are denied or asked, what
a lost call becomes, a model retry, when and how the turn ends); events carry
what the driver measured and the payloads it built (a model step's events and
items, a tool's output after post_tool hooks), which ``Commit`` carries on.

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
                         (Decide) TOOLS <-> AWAITING_APPROVAL (AskApproval)
                       (all calls ended: Export, next step: PREPARING)
    STOPPING -StopDone(continue)-> PREPARING;  STOPPING -StopDone-> COMPLETED
    COMPACTING -CompactionDone(failed; ``retries``: the model call's rule)-> COMPACTING
    COMPACTING -CompactionDone(ok)-> PREPARING with ``ActiveTurn.notice`` open (the new
               context provisional, held by the driver, never stored) until a
               ``Settle`` carried by Prepared / Done / a stopped CompactionDone
               commits it, or ``Finish.notice`` closes it, or a crash drops it
    any live phase -Interrupt / TurnTimedOut / ModelFailed(final) / Abort / Rejected
                   / Done-> ABORTED | FAILED | COMPLETED  (one ``Finish``)

Tool call: ``requested -> dispatched -> started -> ok | failed | unknown``.

Invariants (``tests/engine/test_machine.py`` checks each with a Hypothesis
``RuleBasedStateMachine``):
- A turn ends exactly once: one ``Finish`` (which gives every call left open
  an output); after it every event is ignored (no action).
- No call is dispatched twice unless the model asked twice: a ``CallTool`` for a
  call id follows its ``Commit`` as ``dispatched``; a second one only for an
  idempotent tool after a lost worker (or a restart), up to
  ``Limits.idempotent_tool_attempts``.
- A lost call (worker lost, or in flight across a restart) ends ``unknown``
  unless it is idempotent and attempts are left.
- Every ``Publish`` follows the ``Commit`` of the same events; a ``Decide``
  follows the commit of the calls it decides.
- ``resume(from_checkpoint(to_checkpoint(s)))`` restarts exactly the work that
  was in flight in ``s`` (the model step, the approval, the tool calls as
  above): nothing the machine knows lives outside the checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeAlias, TypeVar

import supervisor.engine.events as ev
from broker.protocol import Failure, FailureKind
from supervisor.engine.approvals import call_key
from supervisor.engine.phases import CallState, TurnPhase, advance_call, advance_phase

MIN_REQUEST_BUDGET_S = 0.05  # a request with less left is not sent: the turn's limit ends it


_set = object.__setattr__
_R = TypeVar("_R")


def _replace(record: _R, **changes: Any) -> _R:
    """``dataclasses.replace`` for the machine's frozen slotted records, without
    its per-call field introspection (a fifth of the machine's CPU per turn in
    the sessions benchmark). Records have no ``__post_init__``; an unknown name
    raises ``AttributeError`` (slots)."""
    new = object.__new__(type(record))
    for name in record.__slots__:  # type: ignore[attr-defined]
        _set(new, name, getattr(record, name))
    for name, value in changes.items():
        _set(new, name, value)
    return new


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
    model_retry_delay_s: float = 0.0  # times the new attempt's number, before it is sent
    approval_timeout_s: float | None = None  # only named in a timed-out answer's texts


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
        return _replace(self, state=advance_call(self.state, target), **changes)

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
    # the open compaction notice (block id): shown pending from ``CompactionDue`` until
    # its compaction settles (``Settle``) or the turn ends (``Finish.notice``)
    notice: str | None = None

    def moved(self, target: TurnPhase, **changes: Any) -> ActiveTurn:
        return _replace(self, phase=advance_phase(self.phase, target), **changes)

    def to_json(self) -> dict[str, Any]:
        return {"turn_id": self.turn_id, "submission_id": self.submission_id,
                "kind": self.kind, "phase": str(self.phase), "model_steps": self.model_steps,
                "model_calls": self.model_calls, "attempt": self.attempt,
                "tool_calls": self.tool_calls, "failed_tool_calls": self.failed_tool_calls,
                "continuations": self.continuations, "started_at": self.started_at,
                "first_sequence": self.first_sequence,
                "tool_rounds": [list(r) for r in self.tool_rounds], "notice": self.notice}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ActiveTurn:
        return cls(str(d["turn_id"]), d.get("submission_id"), str(d.get("kind", "turn")),
                   TurnPhase(d["phase"]), int(d.get("model_steps", 0)),
                   int(d.get("model_calls", 0)), int(d.get("attempt", 0)),
                   int(d.get("tool_calls", 0)), int(d.get("failed_tool_calls", 0)),
                   int(d.get("continuations", 0)), float(d.get("started_at", 0.0)),
                   int(d.get("first_sequence", 1)),
                   tuple(tuple(str(c) for c in r) for r in d.get("tool_rounds", [])),
                   None if d.get("notice") is None else str(d["notice"]))


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
        return _replace(self, calls=tuple(new if c.call_id == new.call_id else c
                                         for c in self.calls))

    def to_checkpoint(self) -> dict[str, Any]:
        """The ``CheckpointState`` fields this turn owns (an ended turn owns none)."""
        if self.ended:
            return {"active_turn": None, "pending_tool_calls": [], "pending_approval": None}
        return {"active_turn": self.turn.to_json(),
                "pending_tool_calls": [c.to_json() for c in self.calls],
                "pending_approval": self.approval_json()}

    def approval_json(self) -> dict[str, Any] | None:
        """The open approval as stored and as its ``exec_approval_request`` shows it."""
        if self.approval is None:
            return None
        asked = [c for c in self.calls if c.call_id in self.approval.call_ids]
        return {"id": self.approval.approval_id, "turn_id": self.turn.turn_id,
                "calls": [{"call_id": c.call_id, "name": c.name,
                           "arguments": dict(c.arguments)} for c in asked],
                "reason": self.approval.reason}

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
#
# Events carry what the driver met and measured: the machine decides with them,
# and the payloads it cannot build itself (the model step's diagnostics, a
# tool's output as a post_tool hook left it, hook contexts) it carries unchanged
# into its ``Commit``.

EventSpec: TypeAlias = tuple[str, Mapping[str, Any]]
Item: TypeAlias = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Begin:
    """The admitted input (or a compact op) starts the turn. The driver built
    what goes with ``turn_started`` in the turn's first commit: ``events`` (the
    ``user_message``), ``items`` (the user's message, the prompt hooks'
    contexts) and ``write`` (the input taken off ``queued_input``)."""

    events: tuple[EventSpec, ...] = ()
    items: tuple[Item, ...] = ()
    write: Any = None


@dataclass(frozen=True, slots=True)
class Settle:
    """A provisional compaction made durable, as the driver built it once the
    usage observer accepted its usage: ``events`` (token_count,
    context_compacted, the notice completed), the new ``context`` (a rewrite)
    and ``write`` (the compaction count, usage, rewrite note, cache breakpoint).
    Carried by ``Prepared``, ``Done`` and a stopped ``CompactionDone``; the
    machine commits it, closing the notice, only while a notice is open."""

    events: tuple[EventSpec, ...] = ()
    context: tuple[Item, ...] = ()
    write: Any = None


@dataclass(frozen=True, slots=True)
class Prepared:
    """pre_model / model_request hooks ran: the model step may be sent (after
    ``settle``, a provisional compaction the request was built on)."""

    route: str | None = None  # named in ``model_step_started``
    settle: Settle | None = None


@dataclass(frozen=True, slots=True)
class CompactionDue:
    """Compaction is due (the threshold or a compact op) and the pre_compact
    hooks let it run: its notice ``block_id`` is shown pending, the call made."""

    block_id: str = "block"


@dataclass(frozen=True, slots=True)
class CompactionDone:
    """The compaction call answered (``ok``: the new context is provisional, held
    by the driver; the post_compact and session_start hooks ran) or failed
    (``failure``). ``stop``: a hook stopped the turn after it (the compaction is
    kept: ``settle``)."""

    ok: bool = True
    failure: Failure | None = None
    stop: str | None = None
    settle: Settle | None = None


@dataclass(frozen=True, slots=True)
class CallSpec:
    """A function call the model asked for, with what the driver knows of it
    before the policy: a verdict if the arguments are bad, the tool is missing or
    a pre_tool hook denied it; None while the approval policy is still to decide
    (``Decide``)."""

    call_id: str
    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    verdict: Verdict | None = Verdict.ALLOW
    reason: str | None = None
    idempotent: bool = False


@dataclass(frozen=True, slots=True)
class ModelReplied:
    """The model step answered (the usage observer accepted its usage and the
    pre_tool hooks ran). ``events``/``items``/``write`` are the step's commit as
    the driver built it (agent_message, model_step_completed with its
    diagnostics, token_count; the assistant items, pre_tool contexts and
    function_call items; the usage and cache bookkeeping); ``notices`` are
    warnings committed after it (dropped calls, renamed call ids)."""

    calls: tuple[CallSpec, ...] = ()
    text: str = ""
    events: tuple[EventSpec, ...] = ()
    items: tuple[Item, ...] = ()
    write: Any = None
    notices: tuple[EventSpec, ...] = ()


@dataclass(frozen=True, slots=True)
class ModelFailed:
    failure: Failure
    diagnostics: Mapping[str, Any] = field(default_factory=dict)
    route: str | None = None


@dataclass(frozen=True, slots=True)
class Decided:
    """The approval policy and permission hooks' verdicts on the undecided calls
    (ASK: the user is asked, under ``approval_id``, with ``reason``)."""

    verdicts: tuple[tuple[str, Verdict, str | None], ...]
    approval_id: str = ""
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ToolStarted:
    call_id: str


@dataclass(frozen=True, slots=True)
class ToolReplied:
    """A call ran and answered; ``output`` as the post_tool hooks left it,
    ``details`` the result's fields for ``tool_call_end`` (isolation, exit_code,
    ...), ``contexts`` the post_tool hooks' context items."""

    call_id: str
    is_error: bool = False
    outcome: str = "ok"
    output: str = ""
    details: Mapping[str, Any] = field(default_factory=dict)
    contexts: tuple[Item, ...] = ()


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
    """The stop hooks ran; ``continue_with``: the context item they continue with."""

    continue_with: Item | None = None


@dataclass(frozen=True, slots=True)
class Done:
    """The turn's work is done without stop hooks: a compact op's turn (``settle``:
    its compaction), or a hook stopped it (``warning``: its reason, committed
    first)."""

    warning: str | None = None
    settle: Settle | None = None


@dataclass(frozen=True, slots=True)
class Interrupt:
    pass


@dataclass(frozen=True, slots=True)
class TurnTimedOut:
    pass


@dataclass(frozen=True, slots=True)
class Rejected:
    """A hook or the user rejected the turn."""

    message: str


@dataclass(frozen=True, slots=True)
class Abort:
    """The turn fails for a reason the driver met (a hook, the usage observer);
    ``message``: turn_aborted's, when it is not the failure's own."""

    failure: Failure
    message: str = ""


Event: TypeAlias = (Begin | Prepared | CompactionDue | CompactionDone | ModelReplied
                    | ModelFailed | Decided | ToolStarted | ToolReplied | ToolFailed
                    | ApprovalAnswered | StopDone | Done | Interrupt | TurnTimedOut | Rejected
                    | Abort)


# ---------------------------------------------------------------- actions


@dataclass(frozen=True, slots=True)
class Commit:
    """Persist ``state`` (``to_checkpoint``), ``events`` and ``items`` in one store
    transaction, with the driver's ``write`` (carried from its event), the keys
    ``approve`` adds to ``approved_for_session``, and the turn's execution record
    when ``execution``. ``point``: the crash point reached right after it."""

    state: TurnState
    events: tuple[EventSpec, ...] = ()
    items: tuple[Item, ...] = ()
    write: Any = None
    approve: tuple[str, ...] = ()
    execution: bool = False
    point: str | None = None
    rewrite: tuple[Item, ...] | None = None  # a settled compaction's new context


@dataclass(frozen=True, slots=True)
class Publish:
    """Show committed events to subscribers."""

    events: tuple[EventSpec, ...]


@dataclass(frozen=True, slots=True)
class RunHook:
    """Hand the turn back to the driver's hooks: pre_model (then ``Prepared`` or
    ``CompactionDue``) or stop (then ``StopDone``)."""

    hook: str  # pre_model | stop


@dataclass(frozen=True, slots=True)
class Wait:
    """Let ``delay_s`` pass before the next action (a model call's retry)."""

    delay_s: float


@dataclass(frozen=True, slots=True)
class CallModel:
    step: int
    attempt: int
    budget_s: float


@dataclass(frozen=True, slots=True)
class Compact:
    """Make the compaction call for notice ``block_id`` (then its hooks):
    ``CompactionDone``."""

    block_id: str
    attempt: int
    budget_s: float


@dataclass(frozen=True, slots=True)
class Decide:
    """Run the approval policy and permission hooks on these calls (``Decided``)."""

    call_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CallTool:
    call_id: str
    name: str
    arguments: Mapping[str, Any]
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


@dataclass(frozen=True, slots=True)
class Finish:
    """The turn's one ending, to commit with the turn's state cleared and then
    the turn_end hooks (a completed turn runs them first: they may still fail
    it). ``ending``/``reason``: turn_complete, or turn_aborted with ``reason``
    (interrupted | rejected | failed) and ``message``; ``failure``: an ``error``
    event first; ``warning``: a warning committed before it; ``open_step``: a
    model step started and not completed (closed as interrupted or failed);
    ``outputs``: a ``function_call_output`` for each call left open;
    ``notice``: a compaction notice left open (completed as cancelled or
    failed; the provisional compaction is dropped)."""

    ending: Ending
    message: str = ""
    failure: Failure | None = None
    warning: str | None = None
    open_step: int | None = None
    outputs: tuple[Item, ...] = ()
    notice: str | None = None

    @property
    def reason(self) -> str:
        """``turn_aborted``'s reason ("" for a completed turn)."""
        return "" if self.ending is Ending.COMPLETED else str(self.ending)


Action: TypeAlias = (Commit | Publish | RunHook | Wait | CallModel | Compact | Decide | CallTool
                     | AskApproval | Cancel | Export | Finish)


# What the model reads for a call that did not run or whose effect is unknown.
LOST_OUTPUT = ("The worker running this tool call was lost before it reported a result. "
               "Whether the call had any effect is unknown; check before repeating it.")
RESTART_OUTPUT = ("The supervisor restarted while this tool call was running. Whether the "
                  "call had any effect is unknown; check before repeating it.")


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

    def commit(self, state: TurnState, *events: EventSpec, items: tuple[Item, ...] = (),
               write: Any = None, approve: tuple[str, ...] = (), execution: bool = False,
               point: str | None = None, rewrite: tuple[Item, ...] | None = None) -> None:
        self.actions.append(Commit(state, tuple(events), items, write, approve, execution,
                                   point, rewrite))
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
    undecided calls are decided, in-flight tool calls are re-dispatched if
    idempotent and attempts are left, else they end ``unknown``; a compaction
    (in flight or provisional: it died with the process) is redone, its notice
    dropped from the state. (The driver closes the events a crash left open,
    ``model_step_started`` and compaction notices, from the journal before it
    resumes.)"""
    if state.ended:
        return state, ()
    out = _Out()
    t = state.turn
    if now - t.started_at >= limits.max_turn_s:
        return _end(state, Ending.FAILED, out, _time_limit(limits)), tuple(out.actions)
    if t.phase in (TurnPhase.STARTING, TurnPhase.PREPARING, TurnPhase.MODEL_CALL,
                   TurnPhase.COMPACTING):
        if t.phase is not TurnPhase.PREPARING or t.notice is not None:
            state = _replace(state, turn=t.moved(TurnPhase.PREPARING, attempt=0, notice=None))
            out.commit(state)
        out.add(RunHook("pre_model"))
    elif t.phase is TurnPhase.STOPPING:
        out.add(RunHook("stop"))
    else:  # TOOLS, AWAITING_APPROVAL
        state = _round(state, limits, now, out, restarted=True)
    return state, tuple(out.actions)


def _time_limit(limits: Limits) -> Failure:
    return Failure("turn_limit", f"the turn ran longer than {limits.max_turn_s}s")


def _step(s: TurnState, e: Event, limits: Limits, now: float, out: _Out) -> TurnState:
    t = s.turn
    tid = t.turn_id
    match e:
        case Interrupt():
            return _end(s, Ending.INTERRUPTED, out, None, "interrupted by the user")
        case TurnTimedOut():
            return _end(s, Ending.FAILED, out, _time_limit(limits))
        case Abort(failure, message):
            return _end(s, Ending.FAILED, out, failure, message)
        case Rejected(message):
            return _end(s, Ending.REJECTED, out, None, message)
        case Done(warning, settle):
            return _end(_settle(s, settle, out), Ending.COMPLETED, out, None, warning=warning)
        case Begin(events, items, write):
            if t.phase is not TurnPhase.STARTING:
                return s
            s = _replace(s, turn=t.moved(TurnPhase.PREPARING))
            started = {"turn_id": tid, "kind": "compact"} if t.kind == "compact" \
                else {"turn_id": tid}
            out.commit(s, ("turn_started", started), *events, items=items, write=write,
                       execution=True)
            out.add(RunHook("pre_model"))
            return s
        case CompactionDue(block_id):
            if t.phase is not TurnPhase.PREPARING or t.notice is not None:
                return s  # one compaction at a time: a provisional one settles first
            s = _replace(s, turn=t.moved(TurnPhase.COMPACTING, attempt=1, notice=block_id))
            out.commit(s, ("frontend_render", ev.render_block(block_id, ev.COMPACTING_TITLE,
                                                              complete=False)))
            out.add(Compact(block_id, 1, budget_s(s, limits.model_call_budget_s, limits, now)))
            return s
        case CompactionDone():
            return _compaction_done(s, e, limits, now, out)
        case Prepared(route, settle):
            if t.phase is not TurnPhase.PREPARING:
                return s  # a stale hook result: nothing to prepare
            s = _settle(s, settle, out)
            t = s.turn
            if t.model_steps >= limits.max_model_steps:
                return _end(s, Ending.FAILED, out, Failure(
                    "turn_limit",
                    f"the turn reached its limit of {limits.max_model_steps} model steps"))
            return _call_model(s, t.model_steps + 1, 1, route, limits, now, out)
        case ModelReplied() | ModelFailed():
            return _on_model(s, e, limits, now, out)
        case Decided(verdicts, approval_id, reason):
            if t.phase is not TurnPhase.TOOLS or s.approval is not None:
                return s
            return _decided(s, verdicts, approval_id, reason, limits, now, out)
        case ToolStarted() | ToolReplied() | ToolFailed():
            return _on_tool(s, e, limits, now, out)
        case ApprovalAnswered(approval_id, decision):
            return _answered(s, approval_id, decision, limits, now, out)
        case StopDone(continue_with):
            if t.phase is not TurnPhase.STOPPING:
                return s
            if continue_with is not None and t.continuations < limits.stop_continuations:
                s = _replace(s, turn=t.moved(TurnPhase.PREPARING,
                                            continuations=t.continuations + 1))
                out.commit(s, items=(continue_with,))
                out.add(RunHook("pre_model"))
                return s
            return _end(s, Ending.COMPLETED, out, None)
    raise TypeError(f"not a turn event: {e!r}")  # pragma: no cover (the union is closed)


def _compaction_done(s: TurnState, e: CompactionDone, limits: Limits, now: float,
                     out: _Out) -> TurnState:
    """The compaction call's answer: retried under the model call's rule
    (``retries``, the notice staying open), a final failure ends the turn, an
    answer makes the new context provisional (back to preparing, the notice
    open until ``Settle``) or, stopped by a hook, settles it and completes."""
    t = s.turn
    if t.phase is not TurnPhase.COMPACTING or t.notice is None:
        return s
    if not e.ok:
        failure = e.failure or Failure(FailureKind.INTERNAL, "the compaction call failed")
        if retries(failure, t.attempt, limits.model_attempts):
            s = _replace(s, turn=_replace(t, attempt=t.attempt + 1))
            out.commit(s, ("warning", ev.warning(
                f"the compaction call failed ({failure.kind}: {ev.clip(failure.message, 500)}); "
                f"trying again (attempt {t.attempt + 1} of {limits.model_attempts})",
                compaction_retry={"attempt": t.attempt, "error": ev.error(failure)})))
            out.add(Wait(limits.model_retry_delay_s * (t.attempt + 1)))
            out.add(Compact(t.notice, t.attempt + 1,
                            budget_s(s, limits.model_call_budget_s, limits, now)))
            return s
        return _end(s, Ending.FAILED, out, Failure(
            failure.kind, f"compaction failed: {failure.kind}: {failure.message}",
            failure.retryable))
    s = _replace(s, turn=t.moved(TurnPhase.PREPARING, attempt=0))
    if e.stop is not None:
        return _end(_settle(s, e.settle, out, always=True), Ending.COMPLETED, out, None,
                    warning=e.stop)
    out.commit(s)
    out.add(RunHook("pre_model"))
    return s


def _settle(s: TurnState, settle: Settle | None, out: _Out, *,
            always: bool = False) -> TurnState:
    """Commit a provisional compaction (the notice closes with it); a settlement
    with no notice open (or none) changes nothing. ``always``: commit the state
    even without a settlement."""
    t = s.turn
    if settle is None or t.notice is None or t.phase is not TurnPhase.PREPARING:
        if always:
            out.commit(s)
        return s
    s = _replace(s, turn=_replace(t, notice=None))
    out.commit(s, *settle.events, write=settle.write, execution=True,
               rewrite=settle.context)
    return s


def _on_model(s: TurnState, e: ModelReplied | ModelFailed, limits: Limits, now: float,
              out: _Out) -> TurnState:
    """The answer to the model step in flight (anything else is stale)."""
    t = s.turn
    tid = t.turn_id
    if t.phase is not TurnPhase.MODEL_CALL:
        return s
    match e:
        case ModelReplied():
            return _model_replied(s, e, limits, now, out)
        case ModelFailed(failure, diagnostics, route):
            again = retries(failure, t.attempt, limits.model_attempts)
            done = ("model_step_completed", {
                "turn_id": tid, "step": t.model_steps, "attempt": t.attempt,
                "outcome": "retrying" if again else "failed",
                "diagnostics": {"error": ev.error(failure), **diagnostics}})
            out.commit(s, done)
            if not again:
                return _end(s, Ending.FAILED, out, Failure(
                    failure.kind, f"model call failed: {failure.kind}: {failure.message}",
                    failure.retryable), open_step=False)
            out.add(Wait(limits.model_retry_delay_s * (t.attempt + 1)))
            return _call_model(s, t.model_steps, t.attempt + 1, route, limits, now, out)
    return s


def _on_tool(s: TurnState, e: ToolStarted | ToolReplied | ToolFailed, limits: Limits,
             now: float, out: _Out) -> TurnState:
    """News of a dispatched call (a call no longer in flight: stale, ignored)."""
    c = s.call(e.call_id)
    if c is None or not c.in_flight or s.turn.phase is not TurnPhase.TOOLS:
        return s  # an answer for a call already ended (lost, interrupted): stale
    match e:
        case ToolStarted():
            if c.state is not CallState.DISPATCHED:
                return s
            s = s.with_call(c.moved(CallState.STARTED))
            out.commit(s, point="tool_running")
            return s
        case ToolReplied(call_id, is_error, outcome, output, details, contexts):
            item: dict[str, Any] = {"type": "function_call_output", "call_id": call_id,
                                    "output": output}
            if is_error:
                item["is_error"] = True
            return _tool_ended(s, c, CallState.FAILED if is_error else CallState.OK, outcome,
                               output, is_error, limits, now, out, details=details,
                               items=(item, *contexts))
        case ToolFailed(_, failure):
            if failure.kind == FailureKind.WORKER_LOST:
                s = _lost(s, c, limits, now, out, LOST_OUTPUT, failure)
                return _maybe_round_done(s, limits, now, out)
            return _tool_ended(s, c, CallState.FAILED, "failed",
                               f"Tool call failed ({failure.kind}): {failure.message}", True,
                               limits, now, out, error=failure)
    return s


def _call_model(s: TurnState, step_no: int, attempt: int, route: str | None, limits: Limits,
                now: float, out: _Out) -> TurnState:
    t = s.turn
    s = _replace(s, turn=t.moved(TurnPhase.MODEL_CALL, model_steps=step_no, attempt=attempt,
                                model_calls=t.model_calls + (attempt == 1)))
    out.commit(s, ("model_step_started", {"turn_id": t.turn_id, "step": step_no,
                                          "attempt": attempt, "route": route}),
               execution=True, point="model_call_before")
    out.add(CallModel(step_no, attempt, budget_s(s, limits.model_call_budget_s, limits, now)))
    return s


def _model_replied(s: TurnState, e: ModelReplied, limits: Limits, now: float,
                   out: _Out) -> TurnState:
    """Commit the step with its calls ``requested``; then the round (or the stop
    hooks, for a final answer)."""
    t = s.turn
    events = e.events or ((("agent_message", {"turn_id": t.turn_id, "text": e.text}),)
                          if e.text else ()) + (
        ("model_step_completed", {"turn_id": t.turn_id, "step": t.model_steps,
                                  "outcome": "completed"}),)
    if not e.calls:
        s = _replace(s, turn=t.moved(TurnPhase.STOPPING, attempt=0))
        out.commit(s, *events, items=e.items, write=e.write, execution=True,
                   point=None if e.notices else "final_answer")
        _notices(s, e.notices, out, "final_answer")
        out.add(RunHook("stop"))
        return s
    pcs = tuple(PendingCall(c.call_id, c.name, dict(c.arguments), CallState.REQUESTED, 0,
                            c.verdict, c.reason, c.idempotent) for c in e.calls)
    s = _replace(s, turn=t.moved(TurnPhase.TOOLS, attempt=0), calls=pcs)
    out.commit(s, *events, items=e.items, write=e.write, execution=True,
               point=None if e.notices else "model_reply")
    _notices(s, e.notices, out, "model_reply")
    return _round(s, limits, now, out)


def _notices(s: TurnState, notices: tuple[EventSpec, ...], out: _Out, point: str) -> None:
    for n, notice in enumerate(notices):
        out.commit(s, notice, point=point if n == len(notices) - 1 else None)


def _round(s: TurnState, limits: Limits, now: float, out: _Out, *,
           restarted: bool = False) -> TurnState:
    """Go on with the round from where it stands: decide the undecided calls, ask
    the open approval, else run what is decided."""
    if s.turn.phase is TurnPhase.AWAITING_APPROVAL and s.approval is not None:
        out.add(AskApproval(s.approval.approval_id, s.approval.call_ids))
        return s
    undecided = tuple(c.call_id for c in s.calls
                      if c.verdict is None and c.state is CallState.REQUESTED)
    if undecided:
        out.add(Decide(undecided))
        return s
    return _run_decided(s, limits, now, out, restarted=restarted)


def _decided(s: TurnState, verdicts: tuple[tuple[str, Verdict, str | None], ...],
             approval_id: str, reason: str, limits: Limits, now: float,
             out: _Out) -> TurnState:
    given = {cid: (v, r) for cid, v, r in verdicts}
    calls = tuple(_replace(c, verdict=given[c.call_id][0], reason=given[c.call_id][1])
                  if c.call_id in given and c.verdict is None else c for c in s.calls)
    ask = tuple(c.call_id for c in calls if c.verdict is Verdict.ASK
                and c.state is CallState.REQUESTED)
    if not ask:
        s = _replace(s, calls=calls)
        out.commit(s)
        return _run_decided(s, limits, now, out)
    s = TurnState(s.turn.moved(TurnPhase.AWAITING_APPROVAL), calls,
                  Approval(approval_id, ask, reason))
    out.commit(s, ("exec_approval_request", s.approval_json() or {}), point="approval_wait")
    out.add(AskApproval(approval_id, ask))
    return s


def _run_decided(s: TurnState, limits: Limits, now: float, out: _Out, *,
                 restarted: bool = False) -> TurnState:
    """The decided round, in the driver's order: end the calls that may not run,
    then (after a restart) the in-flight calls that may not run again, then
    dispatch the allowed ones."""
    for c in s.calls:
        if c.state is CallState.REQUESTED and c.verdict in _NOT_RUN:
            s = _tool_ended(s, c, CallState.FAILED, str(c.verdict),
                            f"Tool call not run: {c.reason}", True, limits, now, out,
                            round_done=False)
    if restarted:
        for c in s.calls:
            if c.in_flight and not reruns_lost(c.idempotent, c.attempt,
                                               limits.idempotent_tool_attempts):
                s = _lost(s, c, limits, now, out, RESTART_OUTPUT, None)
    for c in s.calls:
        if (c.in_flight and restarted) or (c.state is CallState.REQUESTED
                                           and c.verdict is Verdict.ALLOW):
            s = _dispatch(s, c, limits, now, out)
    return _maybe_round_done(s, limits, now, out)


_NOT_RUN = frozenset({Verdict.DENY, Verdict.MISSING, Verdict.BAD})


def _dispatch(s: TurnState, c: PendingCall, limits: Limits, now: float,
              out: _Out) -> TurnState:
    attempt = c.attempt + 1
    s = s.with_call(c.moved(CallState.DISPATCHED, attempt=attempt))
    out.commit(s, ("tool_call_begin", {"turn_id": s.turn.turn_id, "call_id": c.call_id,
                                       "name": c.name, "arguments": dict(c.arguments),
                                       "attempt": attempt}))
    out.add(CallTool(c.call_id, c.name, c.arguments, attempt,
                     budget_s(s, limits.tool_call_budget_s, limits, now)))
    return s


def _lost(s: TurnState, c: PendingCall, limits: Limits, now: float, out: _Out, output: str,
          failure: Failure | None) -> TurnState:
    """A call whose worker (or supervisor) was lost mid-call: re-dispatched only
    if idempotent with attempts left, else it ends ``unknown``."""
    if reruns_lost(c.idempotent, c.attempt, limits.idempotent_tool_attempts):
        return _dispatch(s, c, limits, now, out)
    return _tool_ended(s, c, CallState.UNKNOWN, "unknown", output, True, limits, now, out,
                       error=failure, round_done=False)


def _tool_ended(s: TurnState, c: PendingCall, target: CallState, outcome: str, output: str,
                is_error: bool, limits: Limits, now: float, out: _Out, *,
                error: Failure | None = None, details: Mapping[str, Any] | None = None,
                items: tuple[Item, ...] | None = None, round_done: bool = True) -> TurnState:
    t = s.turn
    s = _replace(s.with_call(c.moved(target, outcome=outcome)),
                turn=_replace(t, tool_calls=t.tool_calls + 1,
                             failed_tool_calls=t.failed_tool_calls + (target is not CallState.OK)))
    payload: dict[str, Any] = {"turn_id": t.turn_id, "call_id": c.call_id, "name": c.name,
                               "output": ev.clip(output), "is_error": is_error,
                               "outcome": outcome, "state": str(target), "isolation": None,
                               "attempt": c.attempt}
    if details:
        payload.update(details)
    if error is not None:
        payload["error"] = ev.error(error)
    if items is None:
        items = ({"type": "function_call_output", "call_id": c.call_id, "output": output,
                  "is_error": True},)
    out.commit(s, ("tool_call_end", payload), items=items, execution=True, point="tool_result")
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
        out.commit(s, ("warning", ev.warning(
            f"approval response targeted a stale request {approval_id}")))
        return s
    if decision == "abort":
        return _end(s, Ending.REJECTED, out, None,
                    "the user aborted the turn at the approval request")
    timeout = "" if limits.approval_timeout_s is None else f"{limits.approval_timeout_s:g}"
    if decision in ("approved", "approved_for_session"):
        verdict, reason = Verdict.ALLOW, f"{decision} by the user"
    elif decision == "timed_out":
        verdict, reason = Verdict.DENY, (
            f"denied: the approval request was not answered within {timeout}s")
    else:
        verdict, reason = Verdict.DENY, "denied by the user"
    asked = set(s.approval.call_ids)
    calls = tuple(_replace(c, verdict=verdict, reason=reason) if c.call_id in asked else c
                  for c in s.calls)
    approve = tuple(call_key(c.name, dict(c.arguments)) for c in calls
                    if c.call_id in asked and decision == "approved_for_session")
    s = TurnState(t.moved(TurnPhase.TOOLS), calls, None)
    events: tuple[EventSpec, ...] = ()
    if decision == "timed_out":
        events = (("warning", ev.warning(
            f"approval request {approval_id} was not answered within {timeout}s; "
            "its calls were denied", approval_id=approval_id)),)
    out.commit(s, *events, approve=approve)
    return _run_decided(s, limits, now, out)


def _end(s: TurnState, how: Ending, out: _Out, failure: Failure | None, message: str = "", *,
         warning: str | None = None, open_step: bool = True) -> TurnState:
    """The turn's one ending: cancel what is in flight, close what is open, finish."""
    t = s.turn
    in_flight = tuple(c.call_id for c in s.calls if c.in_flight)
    model = t.phase in (TurnPhase.MODEL_CALL, TurnPhase.COMPACTING)
    if in_flight or model:
        out.add(Cancel(model, in_flight))
    outputs = []
    for c in s.calls:
        if c.state.terminal:
            continue
        text = f"Tool call not completed: {message or (failure and failure.message)}."
        if c.in_flight:
            text += " It was cancelled while running; its effect may be partial."
        outputs.append({"type": "function_call_output", "call_id": c.call_id,
                        "output": text, "is_error": True})
    step_open = open_step and t.phase is TurnPhase.MODEL_CALL
    out.add(Finish(how, message or (failure.message if failure else ""), failure, warning,
                   t.model_steps if step_open else None, tuple(outputs), t.notice))
    return TurnState(t.moved(_ENDING_PHASE[how], attempt=0, notice=None))
