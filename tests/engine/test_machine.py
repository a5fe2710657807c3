"""The pure turn machine (``supervisor/engine/machine.py``) under random steps.

In-process and fast (no broker, worker, provider or store): a Hypothesis
``RuleBasedStateMachine`` plays the driver. It feeds model replies (with and
without calls, allowed, denied, asked, idempotent or not), model failures,
tool starts, replies and failures, lost workers, approvals (also stale ones),
stop hooks, compaction (answered and settled, stopped by a hook, lost, failed
retryably or not), interrupts,
the turn's time limit, late answers, and a supervisor crash at any step (the
machine restarts from its last ``Commit``, through JSON, and ``resume``).
Invariants:

- a turn ends exactly once;
- no call is dispatched twice unless the model asked twice (only an idempotent
  call after a loss, within its attempts);
- a lost call ends ``unknown``;
- every published event was committed first;
- a compaction notice closes exactly once (settled, or by ``Finish``, or by
  the driver after a crash), and only a settled compaction is compacted;
- resume after any step equals never having crashed: the state read back from
  the last commit is the machine's own state, and resume restarts exactly the
  work that was in flight.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from broker.protocol import Failure
from supervisor.engine.machine import (
    AskApproval,
    Begin,
    CallModel,
    CallSpec,
    CallTool,
    Cancel,
    Commit,
    Compact,
    CompactionDone,
    CompactionDue,
    Decide,
    Decided,
    Done,
    Finish,
    Interrupt,
    Limits,
    ModelFailed,
    ModelReplied,
    Prepared,
    Publish,
    Rejected,
    RunHook,
    Settle,
    StopDone,
    ToolFailed,
    ToolReplied,
    ToolStarted,
    TurnState,
    TurnTimedOut,
    Verdict,
    Wait,
    resume,
    start,
    step,
)
from supervisor.engine.phases import CallState, TurnPhase

LIMITS = Limits(max_model_steps=8, max_turn_s=500.0, model_attempts=3,
                idempotent_tool_attempts=2, stop_continuations=1)
LOST = Failure("worker_lost", "the worker was lost", True)

# pre_tool verdicts: mostly left to the policy (None: ``Decide``), which mostly allows,
# so that tools are often in flight when things go wrong
verdicts = st.sampled_from([None] * 4 + [Verdict.ALLOW, Verdict.DENY, Verdict.MISSING,
                                         Verdict.BAD])
policy = st.sampled_from([Verdict.ALLOW] * 3 + [Verdict.ASK, Verdict.DENY])
calls_st = st.lists(st.tuples(verdicts, st.booleans()), max_size=3)
rarely = st.integers(0, 5)  # a rule that ends the turn runs when this draws 0


class TurnMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.now = 10_000.0
        self.state = start("turn_1", "sub_1", self.now)
        self.durable: TurnState | None = None  # the last committed state
        self.committed: list[tuple[str, Any]] = []  # every committed event, in order
        self.last_commit_events: tuple[Any, ...] | None = None
        self.endings = 0
        self.asked: Counter[str] = Counter()  # call id -> times the model asked for it
        self.dispatched: Counter[str] = Counter()
        self.idempotent: dict[str, bool] = {}
        self.must_be_unknown: set[str] = set()
        self.model_out = False  # a model (or compaction) request is in flight
        self.tools_out: set[str] = set()  # tool calls in flight
        self.hook: str | None = None  # the hook the driver is running
        self.asking: str | None = None  # the approval id shown to the user
        self.deciding: tuple[str, ...] = ()  # calls the policy is deciding
        self.waits = 0
        self.next_call = 0
        self.notices: set[str] = set()  # compaction notices shown pending, not closed
        self.next_notice = 0
        self.compacted = 0  # context_compacted events committed
        self.settled = 0  # settlements the driver handed over while a notice was open
        self.feed(Begin((("user_message", {"text": "hi"}),), ({"type": "message"},)))

    # ------------------------------------------------------------ driver

    def perform(self, actions: tuple[Any, ...]) -> None:
        for a in actions:
            if isinstance(a, Commit):
                self.durable = a.state
                self.committed.extend(a.events)
                self.last_commit_events = a.events
                assert not self.endings, "a commit after the end"
                for name, payload in a.events:
                    if name == "tool_call_end":
                        self.tools_out.discard(payload["call_id"])
                    elif name == "frontend_render":
                        block = payload["block"]
                        if block["state"] == "pending":
                            assert block["id"] not in self.notices, "a notice shown twice"
                            self.notices.add(block["id"])
                        else:
                            assert block["id"] in self.notices, "a notice closed twice"
                            self.notices.discard(block["id"])
                    elif name == "context_compacted":
                        self.compacted += 1
                if a.rewrite is not None:
                    assert ("context_compacted", {}) in a.events, "a rewrite not settled"
                    assert a.state.turn.notice is None, "settled with the notice open"
            elif isinstance(a, Publish):
                assert a.events is self.last_commit_events, "published before its commit"
            elif isinstance(a, CallModel | Compact):
                assert self.durable is not None
                # a compaction is retried under the model call's rule and attempts
                assert 1 <= self.durable.turn.attempt <= LIMITS.model_attempts
                assert self.durable.turn.phase in (
                    TurnPhase.MODEL_CALL, TurnPhase.COMPACTING), "model called before commit"
                self.model_out = True
            elif isinstance(a, CallTool):
                assert self.durable is not None
                c = self.durable.call(a.call_id)
                assert c is not None, "tool dispatched before its commit"
                assert c.state is CallState.DISPATCHED, "tool dispatched before its commit"
                assert c.attempt == a.attempt, "tool dispatched before its commit"
                self.dispatched[a.call_id] += 1
                self.tools_out.add(a.call_id)
            elif isinstance(a, AskApproval):
                self.asking = a.approval_id
            elif isinstance(a, Decide):
                assert self.durable is not None
                for cid in a.call_ids:  # decided only once their requests are durable
                    c = self.durable.call(cid)
                    assert c is not None, "decided before its commit"
                    assert c.verdict is None, "decided twice"
                self.deciding = a.call_ids
            elif isinstance(a, RunHook):
                self.hook = a.hook
            elif isinstance(a, Wait):
                self.waits += 1
            elif isinstance(a, Finish):
                # every call the round left open gets one output, so the context
                # stays well-formed
                open_ = {c.call_id for c in self.before.calls if not c.state.terminal}
                assert {o["call_id"] for o in a.outputs} == open_, "an open call unclosed"
                last = self.durable.turn.notice if self.durable is not None else None
                assert a.notice == last, "an open notice unclosed"
                if a.notice is not None:  # the driver completes it, failed or cancelled
                    assert a.notice in self.notices, "a notice closed twice"
                    self.notices.discard(a.notice)
                self.endings += 1
                assert self.endings <= 1, "the turn ended twice"
                assert self.state.ended
                self.durable = self.state  # the ending's commit clears the turn
                self.hook = self.asking = None
                self.deciding = ()
            elif isinstance(a, Cancel):
                self.model_out = self.model_out and not a.model
                self.tools_out -= set(a.call_ids)

    def feed(self, event: Any) -> None:
        self.before = self.state
        self.state, actions = step(self.state, event, LIMITS, self.now)
        self.perform(actions)

    # ------------------------------------------------------------- rules

    @rule()
    def time_passes(self) -> None:
        self.now += 7.0

    def settlement(self) -> Settle | None:
        """What the driver hands over with its next event: the provisional
        compaction's settlement, while one is open."""
        notice = self.state.turn.notice
        if notice is None:
            return None
        self.settled += 1
        return Settle((("context_compacted", {}),
                       ("frontend_render", {"block": {"id": notice, "state": "complete"}})),
                      ({"type": "compaction"},))

    @precondition(lambda self: self.hook == "pre_model")
    @rule(compact=st.integers(0, 2))  # one in three compacts first
    def pre_model_hooks_ran(self, compact: int) -> None:
        self.hook = None
        if compact == 0 and self.state.turn.notice is None:
            self.next_notice += 1
            self.feed(CompactionDue(f"block_{self.next_notice}"))
        else:
            self.feed(Prepared(settle=self.settlement()))

    @precondition(lambda self: self.model_out
                  and self.state.turn.phase is TurnPhase.COMPACTING)
    @rule(answer=st.sampled_from(["ok", "ok", "ok", "stopped", "lost", "retryable", "fatal"]))
    def compaction_answers(self, answer: str) -> None:
        self.model_out = False
        failure = {"ok": None, "stopped": None, "lost": LOST,
                   "fatal": Failure("bad_request", "no", False),
                   "retryable": Failure("rate_limited", "later", True)}[answer]
        if answer == "stopped":  # a post_compact hook stopped the turn: kept, settled
            self.feed(CompactionDone(stop="a hook stopped", settle=self.settlement()))
            assert self.state.ended
            assert not self.notices
            return
        self.feed(CompactionDone(failure is None, failure))

    @precondition(lambda self: self.model_out
                  and self.state.turn.phase is TurnPhase.MODEL_CALL)
    @rule(calls=calls_st, text=st.sampled_from(["", "hello"]))
    def model_replies(self, calls: list[tuple[Verdict, bool]], text: str) -> None:
        self.model_out = False
        specs = []
        for verdict, idempotent in calls:
            self.next_call += 1
            cid = f"call_{self.next_call}"
            self.asked[cid] += 1
            self.idempotent[cid] = idempotent
            specs.append(CallSpec(cid, "read_file" if idempotent else "shell", {"n": 1},
                                  verdict, None if verdict is None else "pre_tool",
                                  idempotent))
        self.feed(ModelReplied(tuple(specs), text))

    @precondition(lambda self: self.deciding)
    @rule(data=st.data())
    def policy_decides(self, data: st.DataObject) -> None:
        ids, self.deciding = self.deciding, ()
        verdicts_ = tuple((cid, data.draw(policy), "policy") for cid in ids)
        self.feed(Decided(verdicts_, f"approval_{self.next_call}", "asked"))

    @precondition(lambda self: self.hook is not None)
    @rule(how=rarely)
    def a_hook_stops_or_rejects(self, how: int) -> None:
        if how == 0:
            self.feed(Done("a hook stopped the turn",
                           self.settlement() if self.hook == "pre_model" else None))
        elif how == 1:
            self.feed(Rejected("a hook rejected the turn"))
    @precondition(lambda self: self.model_out
                  and self.state.turn.phase is TurnPhase.MODEL_CALL)
    @rule(kind=st.sampled_from(["worker_lost", "timeout", "bad_request"]))
    def model_fails(self, kind: str) -> None:
        self.model_out = False
        self.feed(ModelFailed(Failure(kind, "no", kind != "bad_request")))

    @precondition(lambda self: self.tools_out)
    @rule(data=st.data())
    def tool_starts(self, data: st.DataObject) -> None:
        self.feed(ToolStarted(data.draw(st.sampled_from(sorted(self.tools_out)))))

    @precondition(lambda self: self.tools_out)
    @rule(data=st.data(), is_error=st.booleans())
    def tool_replies(self, data: st.DataObject, is_error: bool) -> None:
        cid = data.draw(st.sampled_from(sorted(self.tools_out)))
        self.tools_out.discard(cid)
        self.feed(ToolReplied(cid, is_error, "error" if is_error else "ok", "out"))

    @precondition(lambda self: self.tools_out)
    @rule(data=st.data())
    def tool_fails(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(sorted(self.tools_out)))
        self.tools_out.discard(cid)
        self.feed(ToolFailed(cid, Failure("internal", "boom")))

    @precondition(lambda self: self.tools_out)
    @rule(data=st.data())
    def tool_worker_lost(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(sorted(self.tools_out)))
        self.tools_out.discard(cid)
        c = self.state.call(cid)
        if c is not None and c.in_flight and (
                not c.idempotent or c.attempt >= LIMITS.idempotent_tool_attempts):
            self.must_be_unknown.add(cid)
        self.feed(ToolFailed(cid, LOST))
        if cid in self.must_be_unknown:
            self.check_unknown(cid)

    @precondition(lambda self: self.tools_out)
    @rule(data=st.data())
    def every_worker_it_reaches_dies(self, data: st.DataObject) -> None:
        """One call is lost again and again: only its attempts bound the re-runs."""
        cid = data.draw(st.sampled_from(sorted(self.tools_out)))
        for _ in range(LIMITS.idempotent_tool_attempts + 1):
            c = self.state.call(cid)
            if cid not in self.tools_out or c is None or not c.in_flight:
                break
            self.tools_out.discard(cid)
            if not c.idempotent or c.attempt >= LIMITS.idempotent_tool_attempts:
                self.must_be_unknown.add(cid)
            self.feed(ToolFailed(cid, LOST))
        if cid in self.must_be_unknown:
            self.check_unknown(cid)

    @precondition(lambda self: self.asked)
    @rule(data=st.data(), is_error=st.booleans())
    def a_late_answer_arrives(self, data: st.DataObject, is_error: bool) -> None:
        """A worker answers a call the machine no longer waits for (lost, ended)."""
        cid = data.draw(st.sampled_from(sorted(self.asked)))
        if cid in self.tools_out:
            return
        before = self.state
        self.feed(ToolReplied(cid, is_error))
        assert self.state == before, "a late answer changed the turn"

    @precondition(lambda self: self.asking is not None)
    @rule(decision=st.sampled_from(["approved", "approved_for_session", "denied", "abort",
                                    "timed_out", "stale"]))
    def user_answers(self, decision: str) -> None:
        from supervisor.engine.machine import ApprovalAnswered

        approval_id = self.asking or ""
        if decision == "stale":
            self.feed(ApprovalAnswered("approval_old", "approved"))
            return
        self.asking = None
        self.feed(ApprovalAnswered(approval_id, decision))

    @precondition(lambda self: self.hook == "stop")
    @rule(again=st.booleans())
    def stop_hooks_ran(self, again: bool) -> None:
        self.hook = None
        self.feed(StopDone({"type": "message", "role": "developer"} if again else None))

    @rule(now=rarely)
    def user_interrupts(self, now: int) -> None:
        if now == 0:
            self.feed(Interrupt())

    @precondition(lambda self: self.now - self.state.turn.started_at > 50)
    @rule(now=rarely)
    def turn_times_out(self, now: int) -> None:
        if now == 0:
            self.feed(TurnTimedOut())

    @rule()
    def supervisor_crashes_and_resumes(self) -> None:
        if self.durable is None:
            return
        stored = json.loads(json.dumps(self.durable.to_checkpoint()))
        restored = TurnState.from_checkpoint(stored)
        if self.state.ended:
            assert restored is None
            return
        assert restored == self.state, "state outside the checkpoint"
        in_flight = [c for c in restored.calls if c.in_flight]
        phase = restored.turn.phase
        approval = restored.approval
        if restored.turn.notice is not None:
            # the provisional compaction died with the process; the driver closes
            # its notice from the journal (``_close_what_the_crash_left_open``)
            self.notices.discard(restored.turn.notice)
        # everything the dead process had in flight is gone with it
        self.model_out, self.tools_out, self.hook, self.asking = False, set(), None, None
        self.deciding = ()
        for c in in_flight:
            if not c.idempotent or c.attempt >= LIMITS.idempotent_tool_attempts:
                self.must_be_unknown.add(c.call_id)
        self.before = restored
        self.state, actions = resume(restored, LIMITS, self.now)
        self.perform(actions)
        if self.state.ended:
            return  # past its time limit: ended at once
        assert self.state.turn.notice is None, "a notice survived the crash"
        # resume restarts exactly what was in flight
        if phase in (TurnPhase.PREPARING, TurnPhase.MODEL_CALL, TurnPhase.COMPACTING):
            assert RunHook("pre_model") in actions
        if phase is TurnPhase.STOPPING:
            assert RunHook("stop") in actions
        if phase is TurnPhase.AWAITING_APPROVAL:
            assert approval is not None
            assert AskApproval(approval.approval_id, approval.call_ids) in actions
        undecided = tuple(c.call_id for c in restored.calls
                          if c.verdict is None and c.state is CallState.REQUESTED)
        if phase is TurnPhase.TOOLS and undecided:
            assert Decide(undecided) in actions
        redispatched = {a.call_id for a in actions if isinstance(a, CallTool)}
        for c in in_flight:
            if c.call_id in self.must_be_unknown:
                self.check_unknown(c.call_id)
            else:
                assert c.call_id in redispatched

    def check_unknown(self, call_id: str) -> None:
        ends = [p for name, p in self.committed
                if name == "tool_call_end" and p["call_id"] == call_id]
        assert ends, f"lost call {call_id} has no end"
        assert ends[-1]["state"] == "unknown", f"lost call {call_id} not unknown"

    # -------------------------------------------------------- invariants

    @invariant()
    def one_source_of_truth(self) -> None:
        if self.durable is not None:
            assert self.state == self.durable, "the state differs from its last commit"

    @invariant()
    def no_call_is_forgotten(self) -> None:
        """A requested call is being decided, or asked, or waits while the others
        are decided or asked; never decided and left."""
        s = self.state
        if s.ended:
            return
        asked = set(s.approval.call_ids) if s.approval is not None else set()
        for c in s.calls:
            if c.state is not CallState.REQUESTED:
                continue
            if c.verdict is None:
                assert c.call_id in self.deciding, f"{c.call_id} is never decided"
            elif c.verdict is Verdict.ASK:
                assert c.call_id in asked, f"{c.call_id} is never asked"
            else:
                assert self.deciding or s.turn.phase is TurnPhase.AWAITING_APPROVAL, \
                    f"{c.call_id} is left"

    @invariant()
    def ends_exactly_once(self) -> None:
        assert self.endings == (1 if self.state.ended else 0)

    @invariant()
    def a_notice_is_open_exactly_while_the_state_says_so(self) -> None:
        notice = self.state.turn.notice
        assert self.notices == (set() if notice is None else {notice})
        assert self.compacted == self.settled, "compacted without a settlement"

    @invariant()
    def no_call_dispatched_twice_unasked(self) -> None:
        for cid, n in self.dispatched.items():
            allowed = LIMITS.idempotent_tool_attempts if self.idempotent[cid] else 1
            assert n <= allowed * self.asked[cid], f"{cid} dispatched {n} times"


TurnMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40,
                                         deadline=None)
test_turn_machine = TurnMachine.TestCase


def test_an_illegal_move_raises() -> None:
    import pytest

    from supervisor.engine.errors import IllegalTransition

    s = start("t", None, 0.0)
    with pytest.raises(IllegalTransition):
        s.turn.moved(TurnPhase.TOOLS)
    c = CallSpec("c", "shell")
    st_, _ = step(s, Begin(), LIMITS, 0.0)
    st_, _ = step(st_, Prepared(), LIMITS, 0.0)
    st_, _ = step(st_, ModelReplied((c,)), LIMITS, 0.0)
    call = st_.call("c")
    assert call is not None
    assert call.state is CallState.DISPATCHED
    with pytest.raises(IllegalTransition):
        call.moved(CallState.REQUESTED)


def test_the_model_budget_is_what_is_left_of_the_turn() -> None:
    s = start("t", None, 0.0)
    s, _ = step(s, Begin(), LIMITS, 0.0)
    _, actions = step(s, Prepared(), LIMITS, 480.0)
    (call,) = [a for a in actions if isinstance(a, CallModel)]
    assert call.budget_s == 20.0  # max_turn_s 500 - 480 elapsed, below the 300 s cap
    _, actions = step(s, Prepared(), LIMITS, 10.0)
    (call,) = [a for a in actions if isinstance(a, CallModel)]
    assert call.budget_s == LIMITS.model_call_budget_s


def test_every_request_carries_what_is_left_of_the_turn() -> None:
    """The one budget rule (docs/architecture.md, "The life of a request"): a model,
    compaction or tool request gets min(what is left of ``max_turn_s`` counted
    from the turn's start, its per-call cap), never below the floor."""
    limits = Limits(max_turn_s=500.0, model_call_budget_s=300.0, tool_call_budget_s=600.0)
    s = start("t", None, 100.0)
    s, _ = step(s, Begin(), limits, 100.0)
    _, actions = step(s, CompactionDue("b"), limits, 450.0)
    (compact,) = [a for a in actions if isinstance(a, Compact)]
    assert compact.budget_s == 150.0  # 500 - (450 - 100)
    s, _ = step(s, Prepared(), limits, 100.0)
    s, actions = step(s, ModelReplied((CallSpec("a", "shell"),)), limits, 200.0)
    (tool,) = [a for a in actions if isinstance(a, CallTool)]
    assert tool.budget_s == 400.0  # 500 - 100, below the 600 s cap
    s2, _ = step(start("u", None, 0.0), Begin(), limits, 0.0)
    _, actions = step(s2, Prepared(), limits, 499.99)
    (call,) = [a for a in actions if isinstance(a, CallModel)]
    assert call.budget_s == 0.05  # the floor: the turn's own limit ends it first


def _to_model_call(limits: Limits = LIMITS) -> TurnState:
    s = start("t", None, 0.0)
    s, _ = step(s, Begin(), limits, 0.0)
    s, _ = step(s, Prepared("main"), limits, 0.0)
    return s


def test_calls_are_decided_after_the_step_is_committed_and_asked_after_the_request() -> None:
    from supervisor.engine.machine import ApprovalAnswered

    s = _to_model_call()
    s, actions = step(s, ModelReplied((CallSpec("a", "shell", {"cmd": "ls"}, None),
                                       CallSpec("b", "nope", {}, Verdict.MISSING, "unknown")),
                                      events=(("model_step_completed", {"step": 1}),),
                                      items=({"type": "function_call", "call_id": "a"},)),
                      LIMITS, 0.0)
    assert [type(a) for a in actions] == [Commit, Publish, Decide]
    step_commit = actions[0]
    assert isinstance(step_commit, Commit)
    assert step_commit.events == (("model_step_completed", {"step": 1}),)  # carried as given
    assert step_commit.items == ({"type": "function_call", "call_id": "a"},)
    assert step_commit.point == "model_reply"
    assert actions[2] == Decide(("a",))
    s, actions = step(s, Decided((("a", Verdict.ASK, "shell asks"),), "ap_1", "shell asks"),
                      LIMITS, 0.0)
    (request,) = [a for a in actions if isinstance(a, Commit)]
    assert request.events == (("exec_approval_request", {
        "id": "ap_1", "turn_id": "t", "reason": "shell asks",
        "calls": [{"call_id": "a", "name": "shell", "arguments": {"cmd": "ls"}}]}),)
    assert request.point == "approval_wait"
    assert actions[-1] == AskApproval("ap_1", ("a",))
    assert s.to_checkpoint()["pending_approval"] == request.events[0][1]
    # approved for the session: the call's key is committed with the verdict
    s, actions = step(s, ApprovalAnswered("ap_1", "approved_for_session"), LIMITS, 0.0)
    commits = [a for a in actions if isinstance(a, Commit)]
    assert len(commits[0].approve) == 1
    # the missing tool ends first (not run), then the approved call is dispatched
    assert commits[1].events[0][0] == "tool_call_end"
    assert commits[1].events[0][1]["outcome"] == "missing"
    assert [a.call_id for a in actions if isinstance(a, CallTool)] == ["a"]


def test_an_unanswered_approval_denies_with_the_timeout_named() -> None:
    from supervisor.engine.machine import ApprovalAnswered

    limits = Limits(approval_timeout_s=5.0)
    s = _to_model_call(limits)
    s, _ = step(s, ModelReplied((CallSpec("a", "shell", {}, None),)), limits, 0.0)
    s, _ = step(s, Decided((("a", Verdict.ASK, "asks"),), "ap", "asks"), limits, 0.0)
    s, actions = step(s, ApprovalAnswered("ap", "timed_out"), limits, 0.0)
    warning = next(a for a in actions if isinstance(a, Commit)).events[0]
    assert warning[0] == "warning"
    assert "was not answered within 5s" in warning[1]["message"]
    end = [a for a in actions if isinstance(a, Commit)][1].events[0][1]
    assert end["outcome"] == "deny"
    assert "within 5s" in end["output"]
    assert not [a for a in actions if isinstance(a, CallTool)]


def test_a_model_retry_waits_then_starts_again_and_a_final_failure_keeps_its_kind() -> None:
    limits = Limits(model_attempts=2, model_retry_delay_s=0.5)
    s = _to_model_call(limits)
    s, actions = step(s, ModelFailed(Failure("rate_limited", "later", True), {}, "main"),
                      limits, 0.0)
    assert [type(a) for a in actions] == [Commit, Publish, Wait, Commit, Publish, CallModel]
    assert actions[2] == Wait(1.0)  # the delay times the new attempt's number
    assert actions[0].events[0][1]["outcome"] == "retrying"  # type: ignore[union-attr]
    assert actions[3].events[0][1]["attempt"] == 2  # type: ignore[union-attr]
    s, actions = step(s, ModelFailed(Failure("rate_limited", "still", True), {}, "main"),
                      limits, 0.0)
    (finish,) = [a for a in actions if isinstance(a, Finish)]
    assert finish.failure is not None
    assert finish.failure.kind == "rate_limited"
    assert finish.message == "model call failed: rate_limited: still"
    assert finish.open_step is None  # its failed completion was committed just before
    assert s.ended
