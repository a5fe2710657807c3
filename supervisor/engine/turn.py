"""The turn driver: one user input (or a compact op) taken to a terminal event.

Its handlers (``toolround``, ``compaction``, ``exporting``) see it only as a
``ports.TurnView`` and never import this module; the session runs it through
its ``Host`` (``SessionManager.run_work``), so the engine has no import cycle.

``Turn.drive`` runs the body in a child task so that an interrupt can cancel
it at any await (model stream, tool calls, approval wait, a slow hook) and
still finish the turn cleanly: partial output is kept, open tool calls get an
output, an open compaction notice is closed, then ``turn_aborted(interrupted)``.

The turn machine (``machine.py``) decides; this driver performs. ``feed``
steps the machine with an event and performs the returned actions in order
(``Commit``: one ``Session.commit`` of the machine's state with the carried
events, items, writes and a compaction's rewrite; ``CallModel``;
``Compact``; ``Decide``; ``AskApproval``; ``CallTool`` as a task;
``Cancel``; ``Export``; ``Wait``; ``Finish``), feeding each result back as
an event, until the machine hands the turn back for the hooks the driver runs
(``RunHook``: pre_model, stop) or it ended. What the driver does around the
machine: builds the turn's first commit from the admitted input, runs the
hooks (pre_compact, pre_model, model_request, stop) and builds the request,
holds a provisional compaction until the machine settles it, and closes
what a crash left open in the journal before ``resume``::

    STARTING   feed(Begin): the admitted input (user_prompt_submit already ran
               at admission, ``Session.admit``) with turn_started + user_message
    loop:
      PREPARING  compaction due (threshold or compact op)? pre_compact hooks,
                 feed(CompactionDue): the machine shows the notice, ``Compact``
                 (retried), the new context provisional; then pre_model,
                 model_request and feed(Prepared(settle)): the machine settles
                 the compaction, runs the model step (retries), the tool round
                 (policy, approvals, dispatch, lost calls, its end and export)
                 and hands back pre_model or stop
      STOPPING   stop hooks; feed(StopDone): one bounded continuation or the end
    an interrupt, the time limit or a failure: ``end`` feeds it to the machine
    from the checkpoint's state, which decides the ending (``Finish``)

Invariants:
- Every step commits (``Session.commit``) before its events are visible; the
  phase, model step count and tool-call states in ``CheckpointState`` are
  updated in the same commit as the events that reflect them.
- A ``TurnError`` fails the turn with an ``error`` event, an execution record
  (outcome failed) and ``turn_aborted(failed)``; the session stays usable.
- The turn's counters, phase, open notice, calls and approval are written only
  by the machine's ``Commit``; the checkpoint is the machine's state.
- ``provisional`` is set only while the machine's notice is open (a commit
  of a state without one, or ``Finish``, drops it).
- Usage reaches the checkpoint only after the usage observer accepted it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any

from broker import plants  # chaos plant switches (broker/plants.py)
from broker.protocol import Failure, FailureKind
from sandbox_worker.api import TIER_ORDER, ModelCallResult, Usage, add_usage, empty_usage
from supervisor import crashpoints
from supervisor.engine import compaction
from supervisor.engine import events as ev
from supervisor.engine.calls import call_model
from supervisor.engine.errors import CallFailed, HookFailed, TurnError
from supervisor.engine.exporting import export_boundary
from supervisor.engine.hooks import HookEvent, context_item
from supervisor.engine.machine import (
    Abort,
    Action,
    ActiveTurn,
    ApprovalAnswered,
    AskApproval,
    Begin,
    CallModel,
    CallSpec,
    CallTool,
    Cancel,
    Commit,
    Compact,
    CompactionDue,
    Decide,
    Done,
    Ending,
    Event,
    EventSpec,
    Export,
    Finish,
    Interrupt,
    Limits,
    ModelFailed,
    ModelReplied,
    Prepared,
    Publish,
    Rejected,
    RunHook,
    StopDone,
    TurnState,
    TurnTimedOut,
    Wait,
    resume,
    step,
)
from supervisor.engine.machine import budget_s as request_budget_s
from supervisor.engine.phases import TurnPhase
from supervisor.engine.ports import Mutate, Provisional, TurnRejected, TurnStopped
from supervisor.engine.session import PendingApproval, Session, Work
from supervisor.engine.tooling import discover, offered_schemas
from supervisor.engine.toolround import (
    Results,
    acknowledge,
    await_approval,
    decide,
    prepare_calls,
    run_call,
)
from supervisor.store.records import ExecutionRecord, SubmissionId, TurnId

log = logging.getLogger(__name__)
_MAX_RESUME_PAGES = 100  # events read to find what a crash left open (1,000 a page)


class Turn:
    def __init__(self, session: Session, turn_id: str, submission_id: SubmissionId | None,
                 kind: str, *, resumed: bool = False) -> None:
        self.session = session
        self.turn_id = TurnId(turn_id)
        self.submission_id = submission_id
        self.kind = kind  # "turn" | "compact"
        self.resumed = resumed
        # The turn's counters live in the machine's record, which is exactly what
        # the checkpoint stores (``Commit``): one copy, nothing to sync.
        self.record = ActiveTurn(self.turn_id, submission_id, kind, TurnPhase.STARTING,
                                 started_at=time.time(),
                                 first_sequence=session.state.next_event_sequence)
        self.started_mono = time.monotonic()
        self.usage: Usage = empty_usage()
        self._usage_of: Usage | None = None  # the usage ``_usage_json`` was made from
        self._usage_json: dict[str, int] = {}
        self.sandbox_tier: str | None = None
        self.partial_text = ""
        self.force_compact = kind == "compact"
        # a compaction that answered and is not settled (the machine's notice is open)
        self.provisional: Provisional | None = None
        self.finishing = False
        self.ended = False  # the ending is committed
        self._limits: Limits | None = None
        self._model_request: dict[str, Any] = {}  # the prepared request (``CallModel``)
        self.last_message = ""
        # approval id -> created_at of its stored exec_approval_request (resumed turns)
        self.approval_requested_at: dict[str, float] = {}
        self._limit: asyncio.Timeout | None = None  # max_turn_s, set by _run
        # the state of the last Commit and the checkpoint objects it wrote
        # (``machine_state``): active_turn, pending_tool_calls, pending_approval
        self._committed: tuple[TurnState, Any, Any, Any] | None = None

    # ---------------------------------------------------------------- setup

    @classmethod
    def for_work(cls, session: Session, work: Work) -> Turn | None:
        st = session.state
        if work.kind == "resume":
            at = st.active_turn
            if at is None:
                return None
            # the machine's record is the checkpoint's (machine.ActiveTurn)
            rec = ActiveTurn.from_json({"started_at": time.time(),
                                        "first_sequence": st.next_event_sequence, **at})
            turn = cls(session, rec.turn_id, _submission(rec.submission_id), rec.kind,
                       resumed=True)
            turn.record = rec
            turn.usage = at.get("usage") or empty_usage()
            return turn
        if work.kind == "compact":
            return cls(session, ev.new_id("turn"), work.submission_id, "compact")
        if not st.queued_input:
            return None
        entry = st.queued_input[0]
        return cls(session, entry.get("turn_id") or ev.new_id("turn"),
                   entry.get("submission_id"), "turn")

    @property
    def phase(self) -> TurnPhase:
        at = self.session.state.active_turn
        return TurnPhase(at["phase"]) if at else TurnPhase.STARTING

    # The record's fields, read as the turn's own: only the machine's commits
    # replace the record.
    @property
    def model_steps(self) -> int:
        return self.record.model_steps

    @property
    def model_calls(self) -> int:
        return self.record.model_calls

    @property
    def tool_calls(self) -> int:
        return self.record.tool_calls

    @property
    def failed_tool_calls(self) -> int:
        return self.record.failed_tool_calls

    @property
    def continuations(self) -> int:
        return self.record.continuations

    @property
    def started_at(self) -> float:
        return self.record.started_at

    @property
    def first_sequence(self) -> int:
        return self.record.first_sequence

    @property
    def tool_rounds(self) -> list[list[str]]:
        """Call ids per completed tool round (a copy)."""
        return [list(r) for r in self.record.tool_rounds]

    def usage_json(self) -> dict[str, int]:
        """The turn's usage as stored: the active turn's and the execution record's
        (converted once per change of ``usage``, not at each of the turn's
        commits; read-only)."""
        if self._usage_of is not self.usage:
            self._usage_of = self.usage
            self._usage_json = _usage_dict(self.usage)
        return self._usage_json

    def note_tier(self, tier: str | None) -> None:
        """The weakest sandbox tier a tool call of the turn ran at (the execution
        record's)."""
        if tier is not None and (self.sandbox_tier is None or TIER_ORDER.get(tier, 0)
                                 < TIER_ORDER.get(self.sandbox_tier, 0)):
            self.sandbox_tier = tier

    def execution(self, outcome: str, reason: str | None = None) -> ExecutionRecord:
        ended = outcome != "running"
        return ExecutionRecord(
            self.session.sid, self.turn_id, outcome, self.model_calls, self.tool_calls,
            self.failed_tool_calls, self.usage_json(), self.started_at,
            time.time() if ended else None,
            time.monotonic() - self.started_mono if ended else None,
            self.sandbox_tier, reason)

    # ---------------------------------------------------------------- drive

    async def drive(self) -> None:
        s = self.session
        s.turn = self
        try:
            async with asyncio.TaskGroup() as tg:
                task = tg.create_task(self._run(), name=f"turn-{self.turn_id}")
                s.turn_task = task
                if s.pending_interrupt == self.turn_id:
                    s.pending_interrupt = None
                    self.interrupt()
            if task.cancelled():
                await self.end(Interrupt())
        finally:
            s.turn = None
            s.turn_task = None

    def interrupt(self) -> None:
        if self.finishing or self.session.turn_task is None:
            return
        self.session.turn_task.cancel()

    async def _run(self) -> None:
        try:
            async with asyncio.timeout(self.session.config.max_turn_s) as limit:
                self._limit = limit
                try:
                    await self._body()
                finally:
                    self._limit = None  # out of its scope: nothing may reschedule it
        except TurnRejected as exc:
            await self.end(Rejected(str(exc)))
        except TurnStopped as exc:
            await self.end(Done(str(exc)))
        except TurnError as exc:
            await self.end(Abort(exc.failure))
        except TimeoutError:
            await self.end(TurnTimedOut())
        except Exception:  # the turn's boundary: a bug fails this turn, cleanly
            log.exception("session %s turn %s: unexpected error", self.session.sid,
                          self.turn_id)
            await self.end(Abort(Failure(FailureKind.INTERNAL,
                                         "internal error in the supervisor; see its log"),
                                 "internal error in the supervisor"))

    async def _body(self) -> None:
        if self.resumed:
            await self._close_what_the_crash_left_open()
            self._limit_from_start()
            stopping = self.phase is TurnPhase.STOPPING
            if stopping:  # the final answer is durable: finish the turn from it
                self.last_message = _last_assistant_text(self.session.context)
            handback = await self.feed(None)
            if stopping and handback == "stop":
                handback = await self._stopping()
                if handback == "ended" and plants.on("double_turn_end"):
                    await self._finish_completed()  # chaos plant: ends the turn again
        else:
            handback = await self.feed(Begin() if self.kind == "compact"
                                       else self._begin_with_input())
        while handback != "ended":
            handback = await (self._stopping() if handback == "stop" else self._step())

    # ------------------------------------------------------- the machine

    def machine_state(self) -> TurnState:
        """The machine's state: exactly the checkpoint's (a turn whose first commit
        has not happened yet: its starting record). While the checkpoint still
        holds the very objects this driver's last ``Commit`` wrote (nothing
        replaces them in between, and nothing edits them in place), that
        commit's state is returned without reading it back."""
        st = self.session.state
        known = self._committed
        if known is not None and known[1] is st.active_turn \
                and known[2] is st.pending_tool_calls and known[3] is st.pending_approval:
            return known[0]
        state = TurnState.from_checkpoint({"active_turn": st.active_turn,
                                           "pending_tool_calls": st.pending_tool_calls,
                                           "pending_approval": st.pending_approval})
        return state if state is not None else TurnState(self.record)

    async def feed(self, event: Event | None) -> str:
        """Step the machine with ``event`` (None: ``resume``) and perform its
        actions in order, feeding their results back as events, until it hands
        the turn back: "pre_model" or "stop" (the driver's hooks run next) or
        "ended" (``Finish`` was performed). Tool calls run as tasks of this
        loop; everything else is performed in turn."""
        state = self.machine_state()
        limits = self.limits
        results: Results = asyncio.Queue()
        tools: dict[str, asyncio.Task[None]] = {}
        handback = ""
        try:
            async with asyncio.TaskGroup() as tg:
                if event is None:
                    if plants.on("rerun_after_restart"):  # chaos plant: in-flight calls rerun
                        state = replace(state, calls=tuple(
                            replace(c, idempotent=True, attempt=0) if c.in_flight else c
                            for c in state.calls))
                    state, actions = resume(state, limits, time.time())
                else:
                    state, actions = step(state, event, limits, time.time())
                ack: asyncio.Future[None] | None = None  # a tool task waits for its commit
                answered: PendingApproval | None = None  # an answer waits for its commit
                while True:
                    got: tuple[Event, PendingApproval | None] | None = None
                    try:
                        for a in actions:
                            if isinstance(a, RunHook):
                                handback = a.hook
                            elif isinstance(a, Finish):
                                handback = "ended"
                            got = await self._perform(a, state, tg, tools, results) or got
                    finally:
                        if ack is not None and not ack.done():
                            ack.set_result(None)
                        if answered is not None:
                            acknowledge(answered)
                    ack = answered = None
                    if handback == "ended":
                        return handback
                    if got is not None:
                        nxt, answered = got
                    else:
                        if handback and not any(c.in_flight for c in state.calls):
                            return handback
                        nxt, ack = await results.get()
                    state, actions = step(state, nxt, limits, time.time())
        except BaseExceptionGroup as group:
            # One call's TurnError (a post_tool hook, the store) ends the round and the
            # turn; the other calls were cancelled and are closed by the ending.
            turn_errors = group.subgroup(TurnError)
            if turn_errors is None:
                raise
            first: BaseException = turn_errors
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from group

    async def _perform(self, a: Action, state: TurnState, tg: asyncio.TaskGroup,
                       tools: dict[str, asyncio.Task[None]], results: Results
                       ) -> tuple[Event, PendingApproval | None] | None:
        """Perform one action; an action answered at once returns its event (and,
        for an approval, the waiter to acknowledge once its answer is committed)."""
        match a:
            case Commit():
                await self._commit(a)
            case Publish():
                pass  # Session.commit shows what it committed, right after the commit
            case RunHook():
                pass  # handed back to the driver (``feed`` returns)
            case Wait(delay_s):
                await asyncio.sleep(delay_s)
            case CallModel():
                return await self._call_model(a), None
            case Decide(call_ids):
                return await decide(self, state, call_ids), None
            case AskApproval(approval_id):
                decision, waiter = await await_approval(
                    self, approval_id, self.approval_requested_at.get(approval_id))
                return ApprovalAnswered(approval_id, decision), waiter
            case CallTool(call_id):
                tools[call_id] = tg.create_task(run_call(self, a, results),
                                                name=f"tool-{call_id}")
            case Cancel(_, call_ids):
                # a model call is awaited in place: only tool calls can be in flight
                for call_id in call_ids:
                    running = tools.get(call_id)
                    if running is not None:
                        running.cancel()
            case Export(_, call_ids):
                await export_boundary(self, list(call_ids))
            case Finish():
                await self._finish(a)
            case Compact():
                return await compaction.run(self, a), None
        return None

    async def _commit(self, a: Commit) -> None:
        """``Commit``: the machine's state is the checkpoint's turn, calls and
        approval; the driver's write, items and events go in the same step."""
        s = self.session
        self.record = a.state.turn
        cp = a.state.to_checkpoint()
        turn = {**cp["active_turn"], "usage": self.usage_json()}

        def mutate(st: Any) -> None:
            if a.write is not None:
                a.write(st)
            st.active_turn = turn
            st.pending_tool_calls = cp["pending_tool_calls"]
            st.pending_approval = cp["pending_approval"]
            for key in a.approve:
                if key not in st.approved_for_session:
                    st.approved_for_session.append(key)
        self._committed = None
        records = await s.commit(
            [(name, dict(payload), self.submission_id) for name, payload in a.events],
            items=[dict(i) for i in a.items] or None,
            rewrite=None if a.rewrite is None else ([dict(i) for i in a.rewrite],
                                                    ["compaction"]),
            execution=self.execution("running") if a.execution else None, mutate=mutate)
        if a.state.turn.notice is None:
            self.provisional = None  # settled (or never made): nothing is provisional
        if not a.state.ended:
            self._committed = (a.state, turn, cp["pending_tool_calls"], cp["pending_approval"])
        for r in records:
            if r.type == ev.EXEC_APPROVAL_REQUEST:
                self.approval_requested_at[str(r.payload.get("id"))] = r.created_at
        if a.point is not None:
            crashpoints.reach(a.point)

    async def end(self, event: Event) -> None:
        """End the turn from outside the machine's loop (an interrupt, the time
        limit, a failure): the machine decides the ending from the checkpoint."""
        if self.ended:
            return
        _, actions = step(self.machine_state(), event, self.limits, time.time())
        for a in actions:
            if isinstance(a, Finish):
                await self._finish(a)

    @property
    def limits(self) -> Limits:
        if self._limits is None:
            cfg = self.session.config
            self._limits = Limits(cfg.max_model_steps, cfg.max_turn_s, cfg.model_attempts,
                                  cfg.idempotent_tool_attempts, cfg.stop_continuations,
                                  cfg.model_call_budget_s, cfg.tool_call_budget_s,
                                  cfg.model_retry_delay_s, cfg.approval_timeout_s)
        return self._limits

    def budget_s(self, cap_s: float) -> float:
        """The budget of a request the turn makes outside the machine's actions (an
        MCP server's listing), by the machine's one rule (``machine.budget_s``):
        what is left of the turn's ``max_turn_s`` counted from its stored start,
        at most ``cap_s``, never below ``MIN_REQUEST_BUDGET_S``."""
        return request_budget_s(TurnState(self.record), cap_s, self.limits, time.time())

    def _limit_from_start(self) -> None:
        """A resumed turn's ``max_turn_s`` counts from the turn's stored start (wall
        clock, the supervisor's downtime included), not from the resume; a clock
        stepped back counts as no time passed. Already past: the limit expires at
        the next await and the turn ends as any turn over its limit. Applied after
        the crash's leftovers are closed, so the journal is whole either way."""
        if self._limit is None:
            return
        elapsed = max(0.0, time.time() - self.started_at)
        left = max(0.0, self.session.config.max_turn_s - elapsed)
        self._limit.reschedule(asyncio.get_running_loop().time() + left)

    async def _close_what_the_crash_left_open(self) -> None:
        """After a supervisor restart, end what clients were shown as started and
        the crash cut off: a model step (``interrupted``; the resumed turn re-issues
        it as a new step) and a compaction notice (``Context compaction
        cancelled``; a retried compaction gets a notice of its own). Tool calls are
        resolved by the tool round from their durable state. The same scan notes
        when each approval request was made (``approval_requested_at``), which
        the approval timeout counts from."""
        s = self.session
        started: dict[int, int] = {}
        blocks: dict[str, str] = {}
        after = self.first_sequence - 1
        for _ in range(_MAX_RESUME_PAGES):
            page = await s.manager.store.events_page(s.sid, after_sequence=after, limit=1000)
            for e in page.items:
                p = e.payload
                if p.get("turn_id") not in (None, self.turn_id):
                    continue
                if e.type == ev.MODEL_STEP_STARTED:
                    started[int(p.get("step", 0))] = e.sequence
                elif e.type == ev.MODEL_STEP_COMPLETED and p.get("outcome") != ev.STEP_RETRYING:
                    started.pop(int(p.get("step", 0)), None)
                elif e.type == ev.EXEC_APPROVAL_REQUEST and isinstance(p.get("id"), str):
                    self.approval_requested_at[p["id"]] = e.created_at
                elif e.type == ev.FRONTEND_RENDER:
                    block = p.get("block") or {}
                    if block.get("state") == "pending":
                        blocks[str(block.get("id"))] = str(block.get("title"))
                    else:
                        blocks.pop(str(block.get("id")), None)
            if not page.items or page.next_cursor is None:
                break
            after = page.items[-1].sequence
        closing: list[tuple[str, dict[str, Any], SubmissionId | None]] = [
            (ev.MODEL_STEP_COMPLETED, {
                "turn_id": self.turn_id, "step": step, "outcome": ev.STEP_INTERRUPTED,
                "diagnostics": {"reason": "supervisor_restarted",
                                "message": "the supervisor restarted during this step; "
                                           "the turn re-issues it"}}, self.submission_id)
            for step in sorted(started)]
        closing += [(ev.FRONTEND_RENDER, ev.render_block(
            block, ev.COMPACTION_CANCELLED_TITLE, complete=True,
            text="the supervisor restarted; compaction is tried again"), self.submission_id)
            for block in blocks]
        if closing:
            await s.commit(closing)

    def _begin_with_input(self) -> Begin:
        """``Begin`` from the admitted input (its prompt hooks already ran): the
        user's message, taken off the queue in the turn's first commit."""
        s = self.session
        entry = s.state.queued_input[0]
        text = str(entry.get("text", ""))
        attachments = list(entry.get("attachments", []))
        content = [{"type": "input_text", "text": text}]
        for a in attachments:
            content.append({"type": "input_text", "text": (
                f"[attachment {a['name']} ({a['media_type']}, {a['size']} bytes), "
                f"id {a['id']}]")})
        item: dict[str, Any] = {"type": "message", "role": "user", "content": content}
        if attachments:
            item["corral"] = {"attachments": attachments}
        items = [item, *(context_item("user_prompt_hook", c)
                         for c in entry.get("contexts", []))]

        def accept(st: Any) -> None:
            st.queued_input = st.queued_input[1:]
        return Begin(((ev.USER_MESSAGE, {"turn_id": self.turn_id, "text": ev.clip(text),
                                         "attachments": attachments}),),
                     tuple(items), accept)

    # ----------------------------------------------------------------- step

    async def _step(self) -> str:
        """Prepare one model step (compaction, pre_model and model_request hooks)
        and feed it to the machine; what it hands back next."""
        s = self.session
        if compaction.due(self):
            block = await compaction.begin(self)  # pre_compact hooks
            if block is not None:
                return await self.feed(CompactionDue(block))
        if self.kind == "compact":
            return await self.feed(Done(settle=await compaction.settlement(self)))
        context = self.provisional.context if self.provisional else s.context
        pre = await s.hooks.run(HookEvent.PRE_MODEL, s.sid, self.turn_id,
                                {"context": context, "step": self.model_steps + 1})
        if pre.rewrite_items is not None or pre.append_items or pre.contexts:
            extra = [*pre.append_items, *(context_item("pre_model_hook", c)
                                          for c in pre.contexts)]
            if self.provisional is not None:
                if pre.rewrite_items is not None:
                    self.provisional.context = list(pre.rewrite_items)
                self.provisional.context.extend(extra)
            elif pre.rewrite_items is not None:
                await s.commit(rewrite=(list(pre.rewrite_items) + extra, ["pre_model_hook"]),
                               mutate=self._note_rewrite(["pre_model_hook"]))
            else:
                await s.commit(items=extra)
            context = self.provisional.context if self.provisional else s.context
        await discover(self)  # the session's MCP servers not listed yet (tooling.py)
        request = self._request(context)
        decorated = await s.hooks.run(HookEvent.MODEL_REQUEST, s.sid, self.turn_id,
                                      {"request": request})
        if decorated.request is not None:
            request = decorated.request
        # The request was built on the provisional context, which is exactly what
        # settles (with its breakpoint): the decorated request stays as it is.
        settle = await compaction.settlement(self)
        self._model_request = request
        return await self.feed(Prepared(s.route_name, settle))

    async def _stopping(self) -> str:
        """Stop hooks after the final answer; the machine decides whether they
        continue the turn (one bounded continuation) or it completes."""
        s = self.session
        stop = await s.hooks.run(HookEvent.STOP, s.sid, self.turn_id,
                                 {"last_message": self.last_message,
                                  "continuations": self.continuations})
        item = context_item("stop_hook", stop.continue_with) if stop.continue_with else None
        return await self.feed(StopDone(item))

    def _note_rewrite(self, reasons: list[str]) -> Any:
        def mutate(st: Any) -> None:
            st.last_rewrite = {"epoch": st.context_epoch + 1, "reasons": reasons,
                               "at_batch": st.next_batch_sequence - 1, "reported": False}
            st.cache_breakpoint = None
        return mutate

    def _request(self, context: list[dict[str, Any]]) -> dict[str, Any]:
        s = self.session
        items = list(context)
        # a provisional compaction resets the breakpoint to its last item at settle
        bp = len(items) - 1 if self.provisional is not None else s.state.cache_breakpoint
        if bp is None or bp >= len(items):
            bp = len(items) - 1
        if bp >= 0:
            marked = dict(items[bp])
            marked["corral"] = {**marked.get("corral", {}), "cache_breakpoint": True}
            items[bp] = marked
        return {"op": "respond", "route": s.manager.route(s.route_name),
                "instructions": s.spec.instructions or s.config.instructions,
                "items": items, "tools": offered_schemas(s), "stream": s.spec.stream,
                "session_id": s.sid, "prompt_cache_key": s.sid}

    # ----------------------------------------------------------- model call

    async def _call_model(self, call: CallModel) -> Event:
        """``CallModel``: the prepared request, sent; ``ModelReplied`` (after the
        usage observer, which may veto, and the pre_tool hooks) or ``ModelFailed``."""
        s = self.session
        self.partial_text = ""
        try:
            result = await call_model(
                s.manager.broker, self._model_request, budget_s=call.budget_s,
                attempt=call.attempt, on_partial=self._on_model_delta,
                cancel_grace_s=s.config.cancel_grace_s)
        except CallFailed as f:
            return ModelFailed(f.failure, {"prompt_cache": self._cache_diagnostics(s.state)},
                               s.route_name)
        calls: list[CallSpec] = []
        call_items: list[dict[str, Any]] = []
        contexts: list[dict[str, Any]] = []
        notices: list[EventSpec] = []
        if any(i.get("type") == "function_call" for i in result["items"]):
            calls, call_items, contexts, notices = await prepare_calls(self, result)
            result = ModelCallResult(**{**result, "items": [
                i for i in result["items"] if i.get("type") != "function_call"]})
        events, items, write = await self._model_step(result, call_items, contexts)
        return ModelReplied(tuple(calls), self.last_message, events, items, write,
                            tuple(notices))

    async def _on_model_delta(self, delta: Any) -> None:
        if not isinstance(delta, dict):
            return
        s = self.session
        kind = delta.get("type")
        if kind == "text_delta" and isinstance(delta.get("text"), str):
            self.partial_text += delta["text"]
            crashpoints.reach("model_stream")
            s.publish_live(ev.AGENT_MESSAGE_DELTA, {"turn_id": self.turn_id,
                                                    "text": delta["text"]}, self.submission_id)
        elif kind == "reasoning_delta" and isinstance(delta.get("text"), str):
            s.publish_live(ev.AGENT_REASONING_DELTA, {"turn_id": self.turn_id,
                                                      "text": delta["text"]},
                           self.submission_id)
        elif kind == "retry":
            if delta.get("discard_partial"):
                self.partial_text = ""
            await s.commit([(ev.MODEL_STEP_COMPLETED, {
                "turn_id": self.turn_id, "step": self.model_steps,
                "outcome": ev.STEP_RETRYING, "diagnostics": {
                    "provider_retry": {k: delta.get(k) for k in
                                       ("attempt", "kind", "message", "delay_s",
                                        "discard_partial")}}}, self.submission_id)])

    def _cache_diagnostics(self, st: Any) -> dict[str, Any]:
        rw = st.last_rewrite
        if rw is not None and not rw.get("reported", True):
            return {"context_epoch": st.context_epoch, "outcome": "context_rewrite",
                    "rewrite_reasons": list(rw.get("reasons", []))}
        return {"context_epoch": st.context_epoch,
                "outcome": "prefix_reuse" if st.cache_breakpoint is not None else "cold",
                "rewrite_reasons": []}

    async def _model_step(self, result: ModelCallResult, call_items: list[dict[str, Any]],
                          extra_items: list[dict[str, Any]]
                          ) -> tuple[tuple[EventSpec, ...], tuple[dict[str, Any], ...],
                                     Mutate]:
        """A model step's commit, as the machine carries it: the usage observer
        first (it may veto), then the step's events, its items (assistant items,
        pre_tool contexts, function calls) and the usage and cache bookkeeping."""
        s = self.session
        usage: Usage = result["usage"]
        if result.get("retries") and plants.on("usage_double_retry"):  # chaos plant
            usage = add_usage(usage, usage)
        await s.manager.observe_usage(s.route_name, usage)
        self.usage = add_usage(self.usage, usage)
        items = [i for i in result["items"] if i.get("type") != "function_call"]
        text = "".join(ev.message_text(i) for i in items
                       if i.get("type") == "message" and i.get("role") == "assistant")
        if text:
            self.last_message = text
        diagnostics = {"prompt_cache": self._cache_diagnostics(s.state),
                       "stop_reason": result.get("stop_reason"),
                       "retries": result.get("retries", 0), "model": result.get("model")}
        events: list[EventSpec] = []
        if text:
            events.append((ev.AGENT_MESSAGE, {"turn_id": self.turn_id, "text": ev.clip(text)}))
        events.append((ev.MODEL_STEP_COMPLETED, {
            "turn_id": self.turn_id, "step": self.model_steps, "outcome": ev.STEP_COMPLETED,
            "diagnostics": diagnostics}))
        all_items = [*items, *extra_items, *call_items]

        def write(st: Any) -> None:
            st.total_usage = dict(add_usage(st.total_usage, usage))
            st.last_usage = dict(usage)
            if st.last_rewrite is not None:
                st.last_rewrite = {**st.last_rewrite, "reported": True}
            # the stable prefix for the next request ends with this step's last item
            st.cache_breakpoint = len(s.context) + len(all_items) - 1
        route = s.manager.route(s.route_name)
        events.append((ev.TOKEN_COUNT, {
            "turn_id": self.turn_id, "last": dict(usage),
            "total": dict(add_usage(s.state.total_usage, usage)),  # type: ignore[arg-type]
            "context_window": route.get("context_window")}))
        self.partial_text = ""
        return tuple(events), tuple(all_items), write

    # ---------------------------------------------------------------- finish

    async def _finish(self, a: Finish) -> None:
        """``Finish``: the turn's one ending, as the machine decided it."""
        self.provisional = None
        if a.ending is Ending.COMPLETED:
            if a.notice is not None:  # a compaction left unsettled: the notice closes
                await compaction.close_notice(self, a.notice, "cancelled")
            if a.warning is not None:
                await self.session.warn(a.warning, self.submission_id)
            await self._finish_completed()
        else:
            await self._finish_aborted(a)

    async def _finish_completed(self) -> None:
        s = self.session
        self.finishing = True
        await self._disarm_limit()
        await self._run_turn_end("completed")
        await s.commit([(ev.TURN_COMPLETE, {"turn_id": self.turn_id,
                                            "last_agent_message": ev.clip(self.last_message)},
                         self.submission_id)],
                       execution=self.execution("completed"), mutate=_clear_turn)
        self.ended = True

    async def _disarm_limit(self) -> None:
        """A turn that has begun to finish ends once: its limit may no longer
        fire. A limit already expired is delivered here, before anything of the
        ending is written (the turn then ends as over its limit, once); else it is
        switched off, so that its expiry cannot land between the commit of
        ``turn_complete`` and that commit's return and end the turn a second time
        (found by the chaos soak: a turn resumed in its stopping phase past its
        limit wrote ``turn_complete`` and then ``turn_aborted``)."""
        limit = self._limit
        if limit is None:
            return
        if limit.expired():
            await asyncio.sleep(0)  # the limit's cancellation is raised here
        else:
            limit.reschedule(None)

    async def _finish_aborted(self, a: Finish) -> None:
        s = self.session
        self.finishing = True
        await self._disarm_limit()
        reason, message = a.reason, a.message
        outcome = "failed" if reason == ev.ABORT_FAILED else "aborted"
        if a.notice is not None:
            await compaction.close_notice(
                self, a.notice, "cancelled" if reason == ev.ABORT_INTERRUPTED else "failed")
        items: list[dict[str, Any]] = []
        events: list[tuple[str, dict[str, Any], SubmissionId | None]] = []
        if self.partial_text:
            items.append({"type": "message", "role": "assistant",
                          "content": [{"type": "output_text", "text": self.partial_text}],
                          "corral": {"partial": True}})
            events.append((ev.AGENT_MESSAGE, {"turn_id": self.turn_id, "partial": True,
                                              "text": ev.clip(self.partial_text)},
                           self.submission_id))
        if a.open_step is not None:
            events.append((ev.MODEL_STEP_COMPLETED, {
                "turn_id": self.turn_id, "step": a.open_step,
                "outcome": ev.STEP_INTERRUPTED if reason == ev.ABORT_INTERRUPTED
                else ev.STEP_FAILED, "diagnostics": {}}, self.submission_id))
        items.extend(dict(i) for i in a.outputs)
        if a.failure is not None:
            events.append((ev.ERROR, ev.error(a.failure), self.submission_id))
        events.append((ev.TURN_ABORTED, {"turn_id": self.turn_id, "reason": reason,
                                         "message": ev.clip(message, 4096)},
                       self.submission_id))
        await s.commit(events, items=items or None,
                       execution=self.execution(outcome, f"{reason}: {message}"[:1000]),
                       mutate=_clear_turn)
        self.ended = True
        self.partial_text = ""
        try:
            await self._run_turn_end(outcome)
        except TurnError as exc:
            log.warning("session %s: turn_end hook failed after abort: %s", s.sid, exc)

    async def _run_turn_end(self, outcome: str) -> None:
        s = self.session
        await s.hooks.run(HookEvent.TURN_END, s.sid, self.turn_id,
                          {"outcome": outcome, "last_message": self.last_message})


def _submission(value: str | None) -> SubmissionId | None:
    return None if value is None else SubmissionId(value)


def _clear_turn(st: Any) -> None:
    """The checkpoint state of a session whose turn ended (in the turn's last commit)."""
    st.active_turn = None
    st.pending_tool_calls = []
    st.pending_approval = None
    st.export_loop_checkpoint = None


def _usage_dict(usage: Usage) -> dict[str, int]:
    return {k: int(v) for k, v in usage.items()}  # type: ignore[call-overload]


async def run_session_start(session: Session, source: str) -> None:
    """session_start outside a turn (startup, resume): may stop or push input."""
    try:
        folded = await session.hooks.run(HookEvent.SESSION_START, session.sid, None,
                                         {"source": source})
    except HookFailed as exc:
        await session.commit([(ev.ERROR, ev.error(exc.failure), None)])
        return
    if folded.stop is not None:
        # Nothing is running: the stop ends the hook run only; it never eats a prompt.
        await session.warn(folded.stop, None, hook="session_start", source=source)
    for text in folded.push_inputs:
        await session.admit(text, [], None)


def _last_assistant_text(context: list[dict[str, Any]]) -> str:
    for item in reversed(context):
        if item.get("type") == "message" and item.get("role") == "assistant":
            return ev.message_text(item)
    return ""
