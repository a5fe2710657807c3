"""One tool round: the function calls of one model step, from ``requested``
to an output each, through approvals and parallel dispatch.

Order of what enters the context (the möbius ordering the tests pin):
``[assistant items..., pre_tool contexts..., function_call...]`` in the model
step's commit, then each call's ``function_call_output`` — followed directly by
its ``post_tool`` context when (and only when) the call really executed — in
completion order, one commit per completed call.

Worker-loss rules:
- A call whose worker is lost is never re-run silently: outcome ``unknown``,
  and the model reads that the worker was lost and the effect is unknown.
  Only tools that say they are idempotent (``tooling.idempotent_in``) are
  re-dispatched (bounded attempts).
- On resume, a call found ``dispatched``/``started`` is resolved the same way
  (``machine.reruns_lost``: an idempotent call is re-dispatched while its
  dispatches are fewer than ``idempotent_tool_attempts``, across restarts too).
- A name the session does not offer gets an error output and is never sent.

call_id uniqueness: a call_id the model gives twice in one step, or one that a
``function_call`` already in the session's context has (``Session.call_ids``:
an earlier step, an earlier turn, a session resumed from the store), runs
under a fresh id with a ``warning {call_id, renamed_to}``. Once a compaction
(or a pre_model rewrite) drops a call from the context its id may be given
again: the provider pairs outputs with calls only within the context it is
sent, so uniqueness there is what correctness needs, and it keeps the check
an O(1) set lookup rebuilt from the loaded context (never the whole
transcript). In the event journal such an id then shows on two
``tool_call_begin``/``tool_call_end`` pairs, told apart by sequence (each end
follows its begin).

Invariants:
- Every function_call in the context gets exactly one function_call_output
  (``close_open_calls`` closes what an interrupt or failure left open).
- The pending approval is durable (``CheckpointState.pending_approval``) before
  ``exec_approval_request`` is visible, and survives a supervisor restart.
- ``approval_timeout_s`` counts from the request, not from the wait: after a
  restart the wait gets what is left of it, measured from the stored
  ``created_at`` of the ``exec_approval_request`` event (wall clock, elapsed
  clamped at 0); none left denies at once, as a timeout does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from broker import plants  # chaos plant switches (broker/plants.py)
from sandbox_worker.api import (
    ModelCallResult,
    ToolCallResult,
    json_size,
    replace_surrogates,
)
from supervisor import crashpoints
from supervisor.engine import bounds
from supervisor.engine import events as ev
from supervisor.engine.approvals import Decision, call_key
from supervisor.engine.calls import call_tool
from supervisor.engine.errors import CallFailed, TurnError
from supervisor.engine.exporting import export_boundary
from supervisor.engine.hooks import HookEvent, context_item
from supervisor.engine.machine import PendingCall, Verdict, reruns_lost
from supervisor.engine.phases import CallState, TurnPhase
from supervisor.engine.ports import TurnRejected, TurnView
from supervisor.engine.session import PendingApproval
from supervisor.engine.tooling import base_request, idempotent_in, offered_in, outside_request
from supervisor.store.records import CheckpointState

log = logging.getLogger(__name__)

LOST_OUTPUT = ("The worker running this tool call was lost before it reported a result. "
               "Whether the call had any effect is unknown; check before repeating it.")
RESTART_OUTPUT = ("The supervisor restarted while this tool call was running. Whether the "
                  "call had any effect is unknown; check before repeating it.")


async def prepare_calls(turn: TurnView, result: ModelCallResult,
                        calls: list[dict[str, Any]]) -> None:
    """Run pre_tool hooks, then commit the model step with its calls ``requested``."""
    s = turn.session
    pcs: list[PendingCall] = []
    contexts: list[dict[str, Any]] = []
    items: list[dict[str, Any]] = []
    seen: set[str] = set()
    renamed: list[tuple[str, str, bool]] = []  # (given, fresh, given earlier in this step)
    dropped = calls[bounds.MAX_CALLS_PER_STEP:]
    calls = calls[:bounds.MAX_CALLS_PER_STEP]
    # The calls' arguments stay in the state row until they are done (and once
    # more in a pending approval): together they get a quarter of its bound.
    budget = s.store_limits.max_state_bytes // 4
    for raw in calls:
        call_id = bounds.clean_id(raw.get("call_id")) or ev.new_id("call")
        if call_id in seen or call_id in s.call_ids:
            # Calls and their outputs are matched by call_id: a second call under
            # the same id would get the first one's output (or be lost). Some
            # servers number calls call_0, call_1... in every response, so an id
            # of an earlier step or turn still in the context counts too. It runs
            # under a fresh id, in the context the model sees next, too.
            fresh = ev.new_id("call")
            renamed.append((call_id, fresh, call_id in seen))
            call_id = fresh
        seen.add(call_id)
        name = replace_surrogates(raw["name"] if isinstance(raw.get("name"), str) else "")
        name = name[:bounds.MAX_NAME_CHARS]
        given = raw.get("arguments", {})
        text = given if isinstance(given, str) else json.dumps(given, default=str)
        args, problem, scrubbed = bounds.parse_arguments(given)
        size = json_size(text)
        if size > budget:
            args, problem = None, (
                f"the arguments are {size} bytes; the calls of one model step may carry "
                f"at most {budget} bytes of arguments in all (write large files in parts)")
            text = json.dumps({"corral_dropped": f"arguments of {size} bytes, not stored"})
        elif scrubbed:
            text = json.dumps(args, ensure_ascii=False)  # as run: lone surrogates replaced
        if args is not None:
            budget -= json_size(args)
        item = {"type": "function_call", "call_id": call_id, "name": name, "arguments": text}
        items.append(item)
        # the machine's record is the checkpoint's (machine.PendingCall)
        pc = PendingCall(call_id, name, args or {}, idempotent=idempotent_in(s, name))
        if problem is not None:
            pc = replace(pc, verdict=Verdict.BAD, reason=problem)
        elif not offered_in(s, name):
            pc = replace(pc, verdict=Verdict.MISSING, reason=(
                f"unknown tool {name!r}; available tools: {', '.join(s.spec.tools)}"))
        else:
            folded = await s.hooks.run(HookEvent.PRE_TOOL, s.sid, turn.turn_id,
                                       {"call_id": call_id, "name": name, "arguments": args})
            contexts.extend(context_item("pre_tool_hook", c) for c in folded.contexts)
            if folded.arguments is not None:
                # A hook's rewrite is held to the same rules as the model's arguments.
                rewritten, why, _ = bounds.parse_arguments(folded.arguments)
                grown = json_size(rewritten) - json_size(args) if rewritten is not None else 0
                if rewritten is None or grown > budget:
                    pc = replace(pc, verdict=Verdict.BAD, arguments={}, reason=(
                        f"a pre_tool hook rewrote the arguments: {why or 'too large'}"))
                else:
                    pc = replace(pc, arguments=rewritten)
                    budget -= grown
            if folded.deny is not None:
                pc = replace(pc, verdict=Verdict.DENY, reason=(  # lives in the state row
                    f"denied by a pre_tool hook: {ev.clip(str(folded.deny), 4096)}"))
        pcs.append(pc)
    result = ModelCallResult(**{**result, "items": [
        i for i in result["items"] if i.get("type") != "function_call"]})

    def mutate(st: Any) -> None:
        put_calls(st, pcs, only=False)
        turn.moving_to(TurnPhase.TOOLS)(st)  # requested, not yet decided
    await turn.commit_model_result(result, items, extra_items=contexts, mutate_more=mutate)
    if dropped:
        await s.warn(f"the model asked for {len(calls) + len(dropped)} tool calls in one step; "
                     f"the {len(dropped)} after the first {bounds.MAX_CALLS_PER_STEP} were "
                     "dropped", turn.submission_id, dropped_calls=len(dropped))
    for old, fresh, in_step in renamed:
        what = ("to more than one call in one step; the later call" if in_step else
                "that an earlier call in the session's context has; this call")
        await s.warn(f"the model gave call_id {old[:100]!r} {what} runs as {fresh!r}",
                     turn.submission_id, call_id=old[:200], renamed_to=fresh)


async def tool_round(turn: TurnView) -> None:
    s = turn.session
    st = s.state
    if st.pending_approval is None and any(pc.verdict is None for pc in pending_calls(st)
                                           if pc.state is CallState.REQUESTED):
        await _decide(turn)
    if s.state.pending_approval is not None:
        await _await_approval(turn)
    await s.commit(mutate=turn.moving_to(TurnPhase.TOOLS))
    pcs = pending_calls(s.state)
    for pc in pcs:
        if not pc.state.terminal and pc.verdict in _NOT_RUN:
            await _finish_call(turn, pc.call_id, CallState.FAILED, str(pc.verdict),
                               f"Tool call not run: {pc.reason}", True, None, executed=False)
    for pc in pcs:
        # in flight when the supervisor stopped: the machine's rule for a lost call
        # (bounded, as a lost worker is: repeated restarts never re-run it unboundedly)
        if pc.in_flight and not reruns_lost(idempotent_in(s, pc.name), pc.attempt,
                                            s.config.idempotent_tool_attempts) \
                and not plants.on("rerun_after_restart"):
            await _finish_call(turn, pc.call_id, CallState.UNKNOWN, "unknown", RESTART_OUTPUT,
                               True, None, executed=False)
    runnable = [pc for pc in pending_calls(s.state)
                if not pc.state.terminal and pc.verdict is Verdict.ALLOW]
    try:
        async with asyncio.TaskGroup() as tg:
            for pc in runnable:
                tg.create_task(_run_call(turn, pc.call_id))
    except BaseExceptionGroup as group:
        # One call's TurnError (a post_tool hook, the store) ends the round and the
        # turn; the other calls were cancelled and are closed by the abort.
        turn_errors = group.subgroup(TurnError)
        if turn_errors is None:
            raise
        first: BaseException = turn_errors
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from group

    def done(st: Any) -> None:
        st.pending_tool_calls = []
        turn.moving_to(TurnPhase.PREPARING)(st)
    await s.commit(mutate=done)
    await export_boundary(turn, [pc.call_id for pc in pcs])


async def _decide(turn: TurnView) -> None:
    """The approval policy, then permission hooks, for the calls not yet decided;
    what is still undecided becomes one approval request (committed with it)."""
    s = turn.session
    approved = frozenset(s.state.approved_for_session)
    decided: list[PendingCall] = []
    ask: list[tuple[PendingCall, str]] = []
    for pc in pending_calls(s.state):
        if pc.verdict is not None or pc.state is not CallState.REQUESTED:
            continue
        decision, reason = s.policy.decide(pc.name, dict(pc.arguments), approved)
        if decision is Decision.ALLOW:
            decided.append(replace(pc, verdict=Verdict.ALLOW, reason=reason))
        elif decision is Decision.DENY:
            decided.append(replace(pc, verdict=Verdict.DENY, reason=reason))
        else:
            ask.append((pc, reason))
    if ask:
        summary = [{"call_id": pc.call_id, "name": pc.name, "arguments": dict(pc.arguments)}
                   for pc, _ in ask]
        folded = await s.hooks.run(HookEvent.PERMISSION_REQUEST, s.sid, turn.turn_id,
                                   {"calls": summary, "reason": "; ".join(r for _, r in ask)})
        if folded.deny is not None:  # any deny wins; no later allow can weaken it
            decided += [replace(pc, verdict=Verdict.DENY, reason=(
                f"denied by a permission hook: {ev.clip(str(folded.deny), 4096)}"))
                for pc, _ in ask]
            ask = []
        elif folded.allow:
            decided += [replace(pc, verdict=Verdict.ALLOW,
                                reason="allowed by a permission hook") for pc, _ in ask]
            ask = []
    if not ask:
        def decide(st: Any) -> None:
            put_calls(st, decided)
            turn.moving_to(TurnPhase.TOOLS)(st)
        await s.commit(mutate=decide)
        return
    decided += [replace(pc, verdict=Verdict.ASK, reason=reason) for pc, reason in ask]
    approval_id = ev.new_id("approval")
    approval = {"id": approval_id, "turn_id": turn.turn_id,
                "calls": [{"call_id": pc.call_id, "name": pc.name,
                           "arguments": dict(pc.arguments)} for pc, _ in ask],
                "reason": "; ".join(r for _, r in ask)}

    def mutate(st: Any) -> None:
        put_calls(st, decided)
        st.pending_approval = approval
        turn.moving_to(TurnPhase.AWAITING_APPROVAL)(st)
    (request, *_) = await s.commit(
        [(ev.EXEC_APPROVAL_REQUEST, dict(approval), turn.submission_id)], mutate=mutate)
    s.approval = PendingApproval(approval_id, turn.turn_id, requested_at=request.created_at,
                                 requested_mono=time.monotonic())
    crashpoints.reach("approval_wait")


async def _await_approval(turn: TurnView) -> None:

    s = turn.session
    pending = s.state.pending_approval
    assert_pending = pending is not None and pending.get("turn_id") == turn.turn_id
    if not assert_pending or pending is None:
        return
    waiter = s.approval
    if waiter is None or waiter.approval_id != pending["id"]:
        waiter = PendingApproval(pending["id"], turn.turn_id)
        s.approval = waiter
    if waiter.requested_at is None and waiter.requested_mono is None:
        # Resumed: the request's time as stored with its event (found by the
        # resumed turn's scan of its events).
        waiter.requested_at = turn.approval_requested_at.get(pending["id"])
    timeout_s = s.config.approval_timeout_s
    left_s = timeout_s
    if timeout_s is not None:
        elapsed_s = waiter.elapsed_s()
        if elapsed_s is None:  # its event is beyond the resume scan: count from now
            log.warning("session %s: approval %s: request time unknown; its timeout "
                        "counts from now", s.sid, pending["id"])
            waiter.requested_mono = time.monotonic()
            elapsed_s = 0.0
        # Already past: a zero timeout still takes an answer that is already
        # there (awaiting a done future does not suspend), else times out.
        left_s = max(0.0, timeout_s - elapsed_s)
    try:
        # Nested in the turn's own timeout: if that one expires first, this
        # block sees a CancelledError, not a TimeoutError, and the turn fails.
        async with asyncio.timeout(left_s):
            decision = await waiter.future
    except TimeoutError:
        # An answer and the timeout in one loop iteration: the answer was taken
        # (no stale warning went out), so it counts.
        done = waiter.future.done() and not waiter.future.cancelled()
        decision = waiter.future.result() if done else "timed_out"
    finally:
        s.approval = None
    try:
        await _apply_answer(turn, pending, decision, timeout_s)
    finally:
        if not waiter.applied.done():  # the answer's submit is acknowledged now
            waiter.applied.set_result(None)


async def _apply_answer(turn: TurnView, pending: dict[str, Any], decision: str,
                        timeout_s: float | None) -> None:
    """Commit the verdicts an approval's answer (or its timeout) gives its calls."""
    s = turn.session
    asked = {c["call_id"] for c in pending["calls"]}
    if decision == "abort":
        raise TurnRejected("the user aborted the turn at the approval request")
    events = []
    if decision == "timed_out":
        events = [(ev.WARNING, ev.warning(
            f"approval request {pending['id']} was not answered within {timeout_s:g}s; "
            "its calls were denied", approval_id=pending["id"]), turn.submission_id)]

    def mutate(st: Any) -> None:
        answered: list[PendingCall] = []
        for pc in pending_calls(st):
            if pc.call_id not in asked:
                continue
            if decision in ("approved", "approved_for_session"):
                answered.append(replace(pc, verdict=Verdict.ALLOW,
                                        reason=f"{decision} by the user"))
                key = call_key(pc.name, dict(pc.arguments))
                if decision == "approved_for_session" and key not in st.approved_for_session:
                    st.approved_for_session.append(key)
            elif decision == "timed_out":
                answered.append(replace(pc, verdict=Verdict.DENY, reason=(
                    f"denied: the approval request was not answered within {timeout_s:g}s")))
            else:
                answered.append(replace(pc, verdict=Verdict.DENY, reason="denied by the user"))
        put_calls(st, answered)
        st.pending_approval = None
        turn.moving_to(TurnPhase.TOOLS)(st)
    await s.commit(events, mutate=mutate)


async def _run_call(turn: TurnView, call_id: str) -> None:
    s = turn.session
    cfg = s.config
    pc = call_of(s.state, call_id)
    name = pc.name
    while True:
        attempt = call_of(s.state, call_id).attempt + 1

        def dispatch(st: Any, attempt: int = attempt) -> None:
            put_calls(st, [call_of(st, call_id).moved(CallState.DISPATCHED, attempt=attempt)])
        await s.commit([(ev.TOOL_CALL_BEGIN, {"turn_id": turn.turn_id, "call_id": call_id,
                                              "name": name, "arguments": dict(pc.arguments),
                                              "attempt": attempt}, turn.submission_id)],
                       mutate=dispatch)
        started = False

        async def on_partial(chunk: Any) -> None:
            nonlocal started
            if not started:
                started = True

                def start(st: Any) -> None:
                    put_calls(st, [call_of(st, call_id).moved(CallState.STARTED)])
                await s.commit(mutate=start)
                crashpoints.reach("tool_running")
            if isinstance(chunk, dict):
                data = chunk.get("data", b"")
                text = data.decode("utf-8", "replace") if isinstance(data, bytes) else str(data)
                s.publish_live(ev.TOOL_CALL_OUTPUT_DELTA, {
                    "turn_id": turn.turn_id, "call_id": call_id,
                    "stream": chunk.get("stream", "stdout"), "text": text[:65536]},
                    turn.submission_id)

        request = outside_request(s, base_request(s, call_id, name, dict(pc.arguments)))
        try:
            result = await call_tool(s.manager.broker, request,
                                     budget_s=turn.budget_s(cfg.tool_call_budget_s),
                                     attempt=attempt, on_partial=on_partial,
                                     cancel_grace_s=cfg.cancel_grace_s)
        except CallFailed as f:
            if f.worker_lost and reruns_lost(idempotent_in(s, name), attempt,
                                             cfg.idempotent_tool_attempts):
                continue
            if f.worker_lost:
                await _finish_call(turn, call_id, CallState.UNKNOWN, "unknown", LOST_OUTPUT,
                                   True, None, executed=False, error=f)
            else:
                await _finish_call(turn, call_id, CallState.FAILED, "failed",
                                   f"Tool call failed ({f.kind}): {f.message}", True, None,
                                   executed=False, error=f)
            return
        is_error = bool(result.get("is_error"))
        await _finish_call(turn, call_id, CallState.FAILED if is_error else CallState.OK,
                           str(result.get("outcome", "error" if is_error else "ok")),
                           result["output"], is_error, result, executed=True)
        return


async def _finish_call(turn: TurnView, call_id: str, state: CallState, outcome: str,
                       output: str, is_error: bool, result: ToolCallResult | None, *,
                       executed: bool, error: CallFailed | None = None) -> None:
    s = turn.session
    pc = call_of(s.state, call_id)
    contexts: list[dict[str, Any]] = []
    if executed:  # post_tool runs only after a real execution
        folded = await s.hooks.run(HookEvent.POST_TOOL, s.sid, turn.turn_id, {
            "call_id": call_id, "name": pc.name, "arguments": dict(pc.arguments),
            "output": output, "is_error": is_error})
        if folded.output is not None:
            output = folded.output
        contexts = [context_item("post_tool_hook", c) for c in folded.contexts]
    isolation = result.get("isolation") if result else None
    tier = isolation.get("tier") if isinstance(isolation, dict) else None
    turn.note_tool_call(state, tier if isinstance(tier, str) else None)
    item: dict[str, Any] = {"type": "function_call_output", "call_id": call_id,
                            "output": output}
    if is_error:
        item["is_error"] = True
    payload: dict[str, Any] = {
        "turn_id": turn.turn_id, "call_id": call_id, "name": pc.name,
        "output": ev.clip(output), "is_error": is_error, "outcome": outcome,
        "state": str(state), "isolation": isolation, "attempt": pc.attempt}
    if result is not None:
        for key in ("exit_code", "signal", "duration_s", "truncated", "error_kind"):
            if key in result:
                payload[key] = result[key]
    if error is not None:
        payload["error"] = ev.error(error.failure)

    def mutate(st: Any) -> None:
        put_calls(st, [call_of(st, call_id).moved(state, outcome=outcome)])
        if st.active_turn is not None:
            st.active_turn = turn.checkpoint_turn(TurnPhase(st.active_turn["phase"]))
    await s.commit([(ev.TOOL_CALL_END, payload, turn.submission_id)],
                   items=[item, *contexts], execution=turn.execution("running"), mutate=mutate)
    crashpoints.reach("tool_result")


def close_open_calls(turn: TurnView, message: str) -> list[dict[str, Any]]:
    """Outputs for every call an abort left open (the context stays well-formed)."""
    items = []
    for pc in pending_calls(turn.session.state):
        if pc.state.terminal:
            continue
        text = f"Tool call not completed: {message}."
        if pc.in_flight:
            text += " It was cancelled while running; its effect may be partial."
        items.append({"type": "function_call_output", "call_id": pc.call_id,
                      "output": text, "is_error": True})
    return items


_NOT_RUN = frozenset({Verdict.DENY, Verdict.MISSING, Verdict.BAD})


def pending_calls(st: CheckpointState) -> list[PendingCall]:
    """The round's calls, typed: ``CheckpointState.pending_tool_calls`` holds
    exactly their ``PendingCall.to_json()`` (written only by ``put_calls``)."""
    return [PendingCall.from_json(d) for d in st.pending_tool_calls]


def call_of(st: CheckpointState, call_id: str) -> PendingCall:
    for d in st.pending_tool_calls:
        if d["call_id"] == call_id:
            return PendingCall.from_json(d)
    raise KeyError(f"no pending tool call {call_id!r}")  # a bug: ids come from the state


def put_calls(st: CheckpointState, calls: Sequence[PendingCall], *, only: bool = True) -> None:
    """Store ``calls`` in the state: replacing the calls of the same id
    (``only``), or as the round's whole list."""
    if not only:
        st.pending_tool_calls = [c.to_json() for c in calls]
        return
    by_id = {c.call_id: c for c in calls}
    st.pending_tool_calls = [by_id[d["call_id"]].to_json() if d["call_id"] in by_id else d
                             for d in st.pending_tool_calls]
