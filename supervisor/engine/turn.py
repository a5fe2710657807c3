"""The turn loop: one user input (or a compact op) taken to a terminal event.

``Turn.drive`` runs the body in a child task so that an interrupt can cancel
it at any await (model stream, tool calls, approval wait, a slow hook) and
still finish the turn cleanly: partial output is kept, open tool calls get an
output, an open compaction notice is closed, then ``turn_aborted(interrupted)``.

Body (re-entrant from the persisted phase, which is how crash resume works)::

    STARTING   the admitted input (user_prompt_submit already ran at admission,
               ``Session.admit``) is committed with turn_started + user_message
    loop:
      PREPARING  compaction (threshold or compact op), pre_model, model_request
      MODEL_CALL model step (bounded retries on worker loss / retryable failures),
                 usage observer, pre_tool hooks; commit items + requested calls
      TOOLS      approvals (AWAITING_APPROVAL), parallel dispatch, outputs in
                 completion order; then export at the tool boundary
      STOPPING   stop hooks may ask for one bounded continuation
    COMPLETED | ABORTED | FAILED

Invariants:
- Every step commits (``Session.commit``) before its events are visible; the
  phase, model step count and tool-call states in ``CheckpointState`` are
  updated in the same commit as the events that reflect them.
- A ``TurnError`` fails the turn with an ``error`` event, an execution record
  (outcome failed) and ``turn_aborted(failed)``; the session stays usable.
- Usage reaches the checkpoint only after the usage observer accepted it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from broker import plants  # chaos plant switches (broker/plants.py)
from sandbox_worker.api import ModelCallResult, Usage, add_usage, empty_usage
from supervisor import crashpoints
from supervisor.engine import events as ev
from supervisor.engine.calls import call_model
from supervisor.engine.errors import (
    CallFailed,
    HookFailed,
    ModelCallFailed,
    TurnError,
    TurnLimitExceeded,
)
from supervisor.engine.hooks import HookEvent, context_item
from supervisor.engine.machine import ActiveTurn
from supervisor.engine.phases import TurnPhase, advance_phase
from supervisor.engine.tooling import tool_schemas
from supervisor.store.records import ExecutionRecord, SubmissionId, TurnId

if TYPE_CHECKING:
    from supervisor.engine.compaction import Provisional
    from supervisor.engine.session import Session, Work

log = logging.getLogger(__name__)
_MAX_RESUME_PAGES = 100  # events read to find what a crash left open (1,000 a page)
MIN_REQUEST_BUDGET_S = 0.05  # the broker client refuses a budget of 0


class TurnRejected(Exception):
    """Internal: the turn ends with turn_aborted(rejected) (prompt hook, approval abort)."""


class TurnStopped(Exception):
    """Internal: a hook stopped the turn; a warning, then turn_complete."""


class Turn:
    def __init__(self, session: Session, turn_id: str, submission_id: SubmissionId | None,
                 kind: str, *, resumed: bool = False) -> None:
        self.session = session
        self.turn_id = TurnId(turn_id)
        self.submission_id = submission_id
        self.kind = kind  # "turn" | "compact"
        self.resumed = resumed
        # The turn's counters live in the machine's record, which is exactly what
        # the checkpoint stores (``_active_turn``): one copy, nothing to sync.
        self.record = ActiveTurn(self.turn_id, submission_id, kind, TurnPhase.STARTING,
                                 started_at=time.time(),
                                 first_sequence=session.state.next_event_sequence)
        self.started_mono = time.monotonic()
        self.usage: Usage = empty_usage()
        self.sandbox_tier: str | None = None
        self.partial_text = ""
        self.force_compact = kind == "compact"
        self.provisional: Provisional | None = None
        self.open_block: str | None = None  # compaction notice awaiting its completion
        self.open_step = False  # a model_step_started without its final completion
        self.finishing = False
        self.last_message = ""
        # approval id -> created_at of its stored exec_approval_request (resumed turns)
        self.approval_requested_at: dict[str, float] = {}
        self._limit: asyncio.Timeout | None = None  # max_turn_s, set by _run

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

    def moving_to(self, target: TurnPhase) -> Any:
        """A ``mutate`` callback for ``Session.commit`` that advances the phase."""
        def mutate(st: Any) -> None:
            if st.active_turn is None:
                st.active_turn = self._active_turn(TurnPhase.STARTING)
            current = TurnPhase(st.active_turn["phase"])
            if current is not target:
                advance_phase(current, target)
            st.active_turn = self._active_turn(target)
        return mutate

    def _active_turn(self, phase: TurnPhase) -> dict[str, Any]:
        """``CheckpointState.active_turn``: the turn's ``ActiveTurn`` record (its
        JSON, at ``phase``; callers moved it through ``advance_phase``) plus the
        turn's usage."""
        self.record = replace(self.record, phase=phase)
        return {**self.record.to_json(), "usage": _usage_dict(self.usage)}

    # The record's fields, read and written as the turn's own (frozen record:
    # a write replaces it).
    @property
    def model_steps(self) -> int:
        return self.record.model_steps

    @model_steps.setter
    def model_steps(self, value: int) -> None:
        self.record = replace(self.record, model_steps=value)

    @property
    def model_calls(self) -> int:
        return self.record.model_calls

    @model_calls.setter
    def model_calls(self, value: int) -> None:
        self.record = replace(self.record, model_calls=value)

    @property
    def tool_calls(self) -> int:
        return self.record.tool_calls

    @tool_calls.setter
    def tool_calls(self, value: int) -> None:
        self.record = replace(self.record, tool_calls=value)

    @property
    def failed_tool_calls(self) -> int:
        return self.record.failed_tool_calls

    @failed_tool_calls.setter
    def failed_tool_calls(self, value: int) -> None:
        self.record = replace(self.record, failed_tool_calls=value)

    @property
    def continuations(self) -> int:
        return self.record.continuations

    @continuations.setter
    def continuations(self, value: int) -> None:
        self.record = replace(self.record, continuations=value)

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

    def add_tool_round(self, call_ids: list[str]) -> None:
        self.record = replace(self.record,
                              tool_rounds=(*self.record.tool_rounds, tuple(call_ids)))

    def execution(self, outcome: str, reason: str | None = None) -> ExecutionRecord:
        ended = outcome != "running"
        return ExecutionRecord(
            self.session.sid, self.turn_id, outcome, self.model_calls, self.tool_calls,
            self.failed_tool_calls, _usage_dict(self.usage), self.started_at,
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
                await self._finish_aborted(ev.ABORT_INTERRUPTED, "interrupted by the user")
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
                await self._body()
        except TurnRejected as exc:
            await self._finish_aborted(ev.ABORT_REJECTED, str(exc))
        except TurnStopped as exc:
            await self.session.warn(str(exc), self.submission_id)
            await self._finish_completed()
        except TurnError as exc:
            await self._finish_aborted(ev.ABORT_FAILED, str(exc), error=exc)
        except TimeoutError:
            exc2 = TurnLimitExceeded(
                f"the turn ran longer than {self.session.config.max_turn_s}s")
            await self._finish_aborted(ev.ABORT_FAILED, str(exc2), error=exc2)
        except Exception:  # the turn's boundary: a bug fails this turn, cleanly
            log.exception("session %s turn %s: unexpected error", self.session.sid,
                          self.turn_id)
            await self._finish_aborted(
                ev.ABORT_FAILED, "internal error in the supervisor",
                error=TurnError("internal error in the supervisor; see its log"))

    async def _body(self) -> None:
        from supervisor.engine.toolround import tool_round

        if self.resumed:
            await self._close_what_the_crash_left_open()
            self._limit_from_start()
        if not self.resumed:
            if self.kind == "compact":
                await self.session.commit(
                    [(ev.TURN_STARTED, {"turn_id": self.turn_id, "kind": "compact"},
                      self.submission_id)],
                    execution=self.execution("running"),
                    mutate=self.moving_to(TurnPhase.STARTING))
                await self.session.commit(mutate=self.moving_to(TurnPhase.PREPARING))
            else:
                await self._start_with_input()
        if self.phase in (TurnPhase.AWAITING_APPROVAL, TurnPhase.TOOLS):
            await tool_round(self)
        elif self.phase is TurnPhase.STOPPING:
            # The final answer is durable: finish the turn from it.
            self.last_message = _last_assistant_text(self.session.context)
            if await self._stopping():
                await self._finish_completed()
                if plants.on("double_turn_end"):  # chaos plant: ends the turn again
                    await self._finish_completed()
                return
        elif self.phase is not TurnPhase.PREPARING:
            # mid model call / compaction / stop hooks: re-issue the step
            await self.session.commit(mutate=self.moving_to(TurnPhase.PREPARING))
        while not await self._step():
            pass
        await self._finish_completed()

    def budget_s(self, cap_s: float) -> float:
        """The budget of a request the turn makes: what is left of the turn's own
        (``max_turn_s``, counted from its start), at most ``cap_s`` (the per-call
        cap of ``EngineConfig``), and never below ``MIN_REQUEST_BUDGET_S`` (a turn
        with less left ends at its own limit, which expires first)."""
        if self._limit is None or (when := self._limit.when()) is None:
            return cap_s
        left = when - asyncio.get_running_loop().time()
        return max(MIN_REQUEST_BUDGET_S, min(cap_s, left))

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

    async def _start_with_input(self) -> None:
        """Start the turn from the admitted input (its prompt hooks already ran)."""
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
            st.active_turn = self._active_turn(TurnPhase.PREPARING)
        await s.commit([(ev.TURN_STARTED, {"turn_id": self.turn_id}, self.submission_id),
                        (ev.USER_MESSAGE, {"turn_id": self.turn_id, "text": ev.clip(text),
                                           "attachments": attachments}, self.submission_id)],
                       items=items, execution=self.execution("running"), mutate=accept)

    # ----------------------------------------------------------------- step

    async def _step(self) -> bool:
        """One model step; True when the turn is done."""
        from supervisor.engine.compaction import maybe_compact, settle
        from supervisor.engine.toolround import prepare_calls, tool_round

        s = self.session
        cfg = s.config
        if self.model_steps >= cfg.max_model_steps:
            raise TurnLimitExceeded(f"the turn reached its limit of {cfg.max_model_steps} "
                                    "model steps")
        await maybe_compact(self)
        if self.kind == "compact":
            if self.provisional is not None:
                await settle(self, "success")
            return True
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
        request = self._request(context)
        decorated = await s.hooks.run(HookEvent.MODEL_REQUEST, s.sid, self.turn_id,
                                      {"request": request})
        if decorated.request is not None:
            request = decorated.request
        if self.provisional is not None:
            # The request was built on the provisional context, which is exactly what
            # settles (with its breakpoint): the decorated request stays as it is.
            await settle(self, "success")
        result = await self._model_call(request)
        calls = [i for i in result["items"] if i.get("type") == "function_call"]
        if calls:
            await prepare_calls(self, result, calls)
            crashpoints.reach("model_reply")
            await tool_round(self)
            return False
        # The final answer and the move to STOPPING are one commit: a restart
        # after it finishes the turn and never asks the model again.
        await self._commit_model_result(result, [],
                                        mutate_more=self.moving_to(TurnPhase.STOPPING))
        crashpoints.reach("final_answer")
        return await self._stopping()

    async def _stopping(self) -> bool:
        """Stop hooks after the final answer; True when the turn is done."""
        s = self.session
        stop = await s.hooks.run(HookEvent.STOP, s.sid, self.turn_id,
                                 {"last_message": self.last_message,
                                  "continuations": self.continuations})
        if stop.continue_with and self.continuations < s.config.stop_continuations:
            self.continuations += 1
            await s.commit(items=[context_item("stop_hook", stop.continue_with)],
                           mutate=self.moving_to(TurnPhase.PREPARING))
            return False
        return True

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
                "items": items, "tools": tool_schemas(s.spec.tools, s.spec.extra),
                "stream": s.spec.stream,
                "session_id": s.sid, "prompt_cache_key": s.sid}

    # ----------------------------------------------------------- model call

    async def _model_call(self, request: dict[str, Any]) -> ModelCallResult:
        s = self.session
        cfg = s.config
        attempt = 1
        self.model_steps += 1
        self.model_calls += 1
        step = self.model_steps
        while True:
            self.partial_text = ""
            await s.commit([(ev.MODEL_STEP_STARTED,
                             {"turn_id": self.turn_id, "step": step, "attempt": attempt,
                              "route": s.route_name}, self.submission_id)],
                           execution=self.execution("running"),
                           mutate=self.moving_to(TurnPhase.MODEL_CALL))
            self.open_step = True
            crashpoints.reach("model_call_before")
            try:
                return await call_model(
                    s.manager.broker, request, budget_s=self.budget_s(cfg.model_call_budget_s),
                    attempt=attempt, on_partial=self._on_model_delta,
                    cancel_grace_s=cfg.cancel_grace_s)
            except CallFailed as f:
                again = (f.retryable or f.worker_lost) and attempt < cfg.model_attempts
                outcome = ev.STEP_RETRYING if again else ev.STEP_FAILED
                await s.commit([(ev.MODEL_STEP_COMPLETED, {
                    "turn_id": self.turn_id, "step": step, "attempt": attempt,
                    "outcome": outcome, "diagnostics": {
                        "error": ev.error(f.failure),
                        "prompt_cache": self._cache_diagnostics(s.state)}},
                    self.submission_id)])
                if not again:
                    self.open_step = False
                    raise ModelCallFailed(f"model call failed: {f.kind}: {f.message}",
                                          kind=f.kind, retryable=f.retryable) from f
                attempt += 1
                await asyncio.sleep(cfg.model_retry_delay_s * attempt)

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

    async def _commit_model_result(self, result: ModelCallResult,
                                   call_items: list[dict[str, Any]],
                                   extra_items: list[dict[str, Any]] | None = None,
                                   mutate_more: Any = None) -> None:
        """Commit a model step: observer first (it may veto), then items + usage."""
        s = self.session
        usage: Usage = result["usage"]
        await s.manager.observe_usage(s.route_name, usage)
        self.usage = add_usage(self.usage, usage)
        items = [i for i in result["items"] if i.get("type") != "function_call"]
        text = "".join(_message_text(i) for i in items
                       if i.get("type") == "message" and i.get("role") == "assistant")
        if text:
            self.last_message = text
        diagnostics = {"prompt_cache": self._cache_diagnostics(s.state),
                       "stop_reason": result.get("stop_reason"),
                       "retries": result.get("retries", 0), "model": result.get("model")}
        events: list[tuple[str, dict[str, Any], SubmissionId | None]] = []
        if text:
            events.append((ev.AGENT_MESSAGE, {"turn_id": self.turn_id, "text": ev.clip(text)},
                           self.submission_id))
        events.append((ev.MODEL_STEP_COMPLETED, {
            "turn_id": self.turn_id, "step": self.model_steps, "outcome": ev.STEP_COMPLETED,
            "diagnostics": diagnostics}, self.submission_id))
        all_items = [*items, *(extra_items or []), *call_items]

        def mutate(st: Any) -> None:
            st.total_usage = dict(add_usage(st.total_usage, usage))
            st.last_usage = dict(usage)
            if st.last_rewrite is not None:
                st.last_rewrite = {**st.last_rewrite, "reported": True}
            # the stable prefix for the next request ends with this step's last item
            st.cache_breakpoint = len(s.context) + len(all_items) - 1
            if mutate_more is not None:
                mutate_more(st)
            st.active_turn = self._active_turn(TurnPhase(st.active_turn["phase"]))
        route = s.manager.route(s.route_name)
        events.append((ev.TOKEN_COUNT, {
            "turn_id": self.turn_id, "last": dict(usage),
            "total": dict(add_usage(s.state.total_usage, usage)),  # type: ignore[arg-type]
            "context_window": route.get("context_window")}, self.submission_id))
        self.partial_text = ""
        await s.commit(events, items=all_items or None, execution=self.execution("running"),
                       mutate=mutate)
        self.open_step = False

    # ---------------------------------------------------------------- finish

    async def _finish_completed(self) -> None:
        s = self.session
        self.finishing = True
        await self._run_turn_end("completed")
        await s.commit([(ev.TURN_COMPLETE, {"turn_id": self.turn_id,
                                            "last_agent_message": ev.clip(self.last_message)},
                         self.submission_id)],
                       execution=self.execution("completed"), mutate=_clear_turn)

    async def _finish_aborted(self, reason: str, message: str,
                              error: TurnError | None = None) -> None:
        from supervisor.engine.compaction import close_notice
        from supervisor.engine.toolround import close_open_calls

        s = self.session
        self.finishing = True
        outcome = "failed" if reason == ev.ABORT_FAILED else "aborted"
        if self.open_block is not None:
            await close_notice(self, "cancelled" if reason == ev.ABORT_INTERRUPTED else "failed")
        items: list[dict[str, Any]] = []
        events: list[tuple[str, dict[str, Any], SubmissionId | None]] = []
        if self.partial_text:
            items.append({"type": "message", "role": "assistant",
                          "content": [{"type": "output_text", "text": self.partial_text}],
                          "corral": {"partial": True}})
            events.append((ev.AGENT_MESSAGE, {"turn_id": self.turn_id, "partial": True,
                                              "text": ev.clip(self.partial_text)},
                           self.submission_id))
        if self.open_step:
            self.open_step = False
            events.append((ev.MODEL_STEP_COMPLETED, {
                "turn_id": self.turn_id, "step": self.model_steps,
                "outcome": ev.STEP_INTERRUPTED if reason == ev.ABORT_INTERRUPTED
                else ev.STEP_FAILED, "diagnostics": {}}, self.submission_id))
        items.extend(close_open_calls(self, message))
        if error is not None:
            events.append((ev.ERROR, ev.error(error.failure), self.submission_id))
        events.append((ev.TURN_ABORTED, {"turn_id": self.turn_id, "reason": reason,
                                         "message": ev.clip(message, 4096)},
                       self.submission_id))
        await s.commit(events, items=items or None,
                       execution=self.execution(outcome, f"{reason}: {message}"[:1000]),
                       mutate=_clear_turn)
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


def _message_text(item: dict[str, Any]) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return "".join(p.get("text", "") for p in content
                   if isinstance(p, dict) and isinstance(p.get("text"), str))


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
            return _message_text(item)
    return ""
