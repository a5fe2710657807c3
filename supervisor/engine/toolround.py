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
  Only ``IDEMPOTENT_TOOLS`` are re-dispatched (bounded attempts).
- On resume, a call found ``dispatched``/``started`` is resolved the same way.
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
from typing import TYPE_CHECKING, Any

from broker import plants  # chaos plant switches (broker/plants.py)
from sandbox_worker.api import (
    IDEMPOTENT_TOOLS,
    TIER_ORDER,
    ModelCallResult,
    ToolCallRequest,
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
from supervisor.engine.hooks import HookEvent, context_item
from supervisor.engine.machine import PendingCall
from supervisor.engine.phases import CallState, TurnPhase, advance_call
from supervisor.engine.session import PendingApproval
from supervisor.engine.tooling import offered

if TYPE_CHECKING:
    from supervisor.engine.turn import Turn

log = logging.getLogger(__name__)

LOST_OUTPUT = ("The worker running this tool call was lost before it reported a result. "
               "Whether the call had any effect is unknown; check before repeating it.")
RESTART_OUTPUT = ("The supervisor restarted while this tool call was running. Whether the "
                  "call had any effect is unknown; check before repeating it.")


async def prepare_calls(turn: Turn, result: ModelCallResult,
                        calls: list[dict[str, Any]]) -> None:
    """Run pre_tool hooks, then commit the model step with its calls ``requested``."""
    s = turn.session
    pcs: list[dict[str, Any]] = []
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
        pc = PendingCall(call_id, name, args or {},
                         idempotent=name in IDEMPOTENT_TOOLS).to_json()
        if problem is not None:
            pc["verdict"], pc["reason"] = "bad", problem
        elif not offered(s.spec.tools, name, s.spec.extra):
            pc["verdict"], pc["reason"] = "missing", (
                f"unknown tool {name!r}; available tools: {', '.join(s.spec.tools)}")
        else:
            folded = await s.hooks.run(HookEvent.PRE_TOOL, s.sid, turn.turn_id,
                                       {"call_id": call_id, "name": name, "arguments": args})
            contexts.extend(context_item("pre_tool_hook", c) for c in folded.contexts)
            if folded.arguments is not None:
                # A hook's rewrite is held to the same rules as the model's arguments.
                rewritten, why, _ = bounds.parse_arguments(folded.arguments)
                grown = json_size(rewritten) - json_size(args) if rewritten is not None else 0
                if rewritten is None or grown > budget:
                    pc["verdict"], pc["reason"] = "bad", (
                        f"a pre_tool hook rewrote the arguments: {why or 'too large'}")
                    pc["arguments"] = {}
                else:
                    pc["arguments"] = rewritten
                    budget -= grown
            if folded.deny is not None:
                pc["verdict"], pc["reason"] = "deny", (  # the reason lives in the state row
                    f"denied by a pre_tool hook: {ev.clip(str(folded.deny), 4096)}")
        pcs.append(pc)
    result = ModelCallResult(**{**result, "items": [
        i for i in result["items"] if i.get("type") != "function_call"]})

    def mutate(st: Any) -> None:
        st.pending_tool_calls = pcs
        st.active_turn["phase"] = str(TurnPhase.TOOLS)  # requested, not yet decided
    await turn._commit_model_result(result, items, extra_items=contexts, mutate_more=mutate)
    if dropped:
        await s.warn(f"the model asked for {len(calls) + len(dropped)} tool calls in one step; "
                     f"the {len(dropped)} after the first {bounds.MAX_CALLS_PER_STEP} were "
                     "dropped", turn.submission_id, dropped_calls=len(dropped))
    for old, fresh, in_step in renamed:
        what = ("to more than one call in one step; the later call" if in_step else
                "that an earlier call in the session's context has; this call")
        await s.warn(f"the model gave call_id {old[:100]!r} {what} runs as {fresh!r}",
                     turn.submission_id, call_id=old[:200], renamed_to=fresh)


async def tool_round(turn: Turn) -> None:
    s = turn.session
    st = s.state
    pcs = st.pending_tool_calls
    if st.pending_approval is None and any(pc.get("verdict") is None for pc in pcs
                                           if pc["state"] == CallState.REQUESTED):
        await _decide(turn, pcs)
    if s.state.pending_approval is not None:
        await _await_approval(turn)
    pcs = s.state.pending_tool_calls
    await s.commit(mutate=turn.moving_to(TurnPhase.TOOLS))
    for pc in pcs:
        if not CallState(pc["state"]).terminal and pc.get("verdict") in ("deny", "missing", "bad"):
            await _finish_call(turn, pc, CallState.FAILED, pc["verdict"],
                               f"Tool call not run: {pc['reason']}", True, None, executed=False)
    resumed = [pc for pc in pcs if pc["state"] in (CallState.DISPATCHED, CallState.STARTED)]
    for pc in resumed:
        if pc["name"] not in IDEMPOTENT_TOOLS and not plants.on("rerun_after_restart"):
            await _finish_call(turn, pc, CallState.UNKNOWN, "unknown", RESTART_OUTPUT, True,
                               None, executed=False)
    runnable = [pc for pc in pcs if not CallState(pc["state"]).terminal
                and pc.get("verdict") == "allow"]
    try:
        async with asyncio.TaskGroup() as tg:
            for pc in runnable:
                tg.create_task(_run_call(turn, pc))
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
    from supervisor.engine.exporting import export_boundary
    await export_boundary(turn, [pc["call_id"] for pc in pcs])


async def _decide(turn: Turn, pcs: list[dict[str, Any]]) -> None:
    s = turn.session
    approved = frozenset(s.state.approved_for_session)
    ask: list[tuple[dict[str, Any], str]] = []
    for pc in pcs:
        if pc.get("verdict") is not None or pc["state"] != CallState.REQUESTED:
            continue
        decision, reason = s.policy.decide(pc["name"], pc["arguments"], approved)
        if decision is Decision.ALLOW:
            pc["verdict"], pc["reason"] = "allow", reason
        elif decision is Decision.DENY:
            pc["verdict"], pc["reason"] = "deny", reason
        else:
            ask.append((pc, reason))
    if ask:
        summary = [{"call_id": pc["call_id"], "name": pc["name"], "arguments": pc["arguments"]}
                   for pc, _ in ask]
        folded = await s.hooks.run(HookEvent.PERMISSION_REQUEST, s.sid, turn.turn_id,
                                   {"calls": summary, "reason": "; ".join(r for _, r in ask)})
        if folded.deny is not None:  # any deny wins; no later allow can weaken it
            for pc, _ in ask:
                pc["verdict"], pc["reason"] = "deny", (
                    f"denied by a permission hook: {ev.clip(str(folded.deny), 4096)}")
            ask = []
        elif folded.allow:
            for pc, _ in ask:
                pc["verdict"], pc["reason"] = "allow", "allowed by a permission hook"
            ask = []
    if not ask:
        await s.commit(mutate=turn.moving_to(TurnPhase.TOOLS))
        return
    for pc, reason in ask:
        pc["verdict"], pc["reason"] = "ask", reason
    approval_id = ev.new_id("approval")
    approval = {"id": approval_id, "turn_id": turn.turn_id,
                "calls": [{"call_id": pc["call_id"], "name": pc["name"],
                           "arguments": pc["arguments"]} for pc, _ in ask],
                "reason": "; ".join(r for _, r in ask)}

    def mutate(st: Any) -> None:
        st.pending_approval = approval
        turn.moving_to(TurnPhase.AWAITING_APPROVAL)(st)
    (request, *_) = await s.commit(
        [(ev.EXEC_APPROVAL_REQUEST, dict(approval), turn.submission_id)], mutate=mutate)
    s.approval = PendingApproval(approval_id, turn.turn_id, requested_at=request.created_at,
                                 requested_mono=time.monotonic())
    crashpoints.reach("approval_wait")


async def _await_approval(turn: Turn) -> None:

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


async def _apply_answer(turn: Turn, pending: dict[str, Any], decision: str,
                        timeout_s: float | None) -> None:
    """Commit the verdicts an approval's answer (or its timeout) gives its calls."""
    from supervisor.engine.turn import TurnRejected

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
        for pc in st.pending_tool_calls:
            if pc["call_id"] not in asked:
                continue
            if decision in ("approved", "approved_for_session"):
                pc["verdict"], pc["reason"] = "allow", f"{decision} by the user"
                key = call_key(pc["name"], pc["arguments"])
                if decision == "approved_for_session" and key not in st.approved_for_session:
                    st.approved_for_session.append(key)
            elif decision == "timed_out":
                pc["verdict"], pc["reason"] = "deny", (
                    f"denied: the approval request was not answered within {timeout_s:g}s")
            else:
                pc["verdict"], pc["reason"] = "deny", "denied by the user"
        st.pending_approval = None
        turn.moving_to(TurnPhase.TOOLS)(st)
    await s.commit(events, mutate=mutate)


async def _run_call(turn: Turn, pc: dict[str, Any]) -> None:
    s = turn.session
    cfg = s.config
    name = pc["name"]
    while True:
        attempt = int(pc.get("attempt", 0)) + 1

        def dispatch(st: Any, attempt: int = attempt) -> None:
            pc["state"] = str(advance_call(CallState(pc["state"]), CallState.DISPATCHED))
            pc["attempt"] = attempt
        await s.commit([(ev.TOOL_CALL_BEGIN, {"turn_id": turn.turn_id, "call_id": pc["call_id"],
                                              "name": name, "arguments": pc["arguments"],
                                              "attempt": attempt}, turn.submission_id)],
                       mutate=dispatch)
        started = False

        async def on_partial(chunk: Any) -> None:
            nonlocal started
            if not started:
                started = True

                def start(st: Any) -> None:
                    pc["state"] = str(advance_call(CallState(pc["state"]), CallState.STARTED))
                await s.commit(mutate=start)
                crashpoints.reach("tool_running")
            if isinstance(chunk, dict):
                data = chunk.get("data", b"")
                text = data.decode("utf-8", "replace") if isinstance(data, bytes) else str(data)
                s.publish_live(ev.TOOL_CALL_OUTPUT_DELTA, {
                    "turn_id": turn.turn_id, "call_id": pc["call_id"],
                    "stream": chunk.get("stream", "stdout"), "text": text[:65536]},
                    turn.submission_id)

        request = ToolCallRequest(call_id=pc["call_id"], tool=name, arguments=pc["arguments"],
                                  session_id=s.sid, workspace=s.spec.workspace,
                                  policy=s.spec.tool_policy)
        identity = s.spec.extra.get("workspace_identity")
        if isinstance(identity, list):  # pinned at creation (facade)
            request["workspace_identity"] = identity
            request["workspace_host"] = str(s.spec.extra.get("workspace_host", ""))
        try:
            result = await call_tool(s.manager.broker, request,
                                     budget_s=turn.budget_s(cfg.tool_call_budget_s),
                                     attempt=attempt, on_partial=on_partial,
                                     cancel_grace_s=cfg.cancel_grace_s)
        except CallFailed as f:
            if f.worker_lost and name in IDEMPOTENT_TOOLS \
                    and attempt < cfg.idempotent_tool_attempts:
                continue
            if f.worker_lost:
                await _finish_call(turn, pc, CallState.UNKNOWN, "unknown", LOST_OUTPUT, True,
                                   None, executed=False, error=f)
            else:
                await _finish_call(turn, pc, CallState.FAILED, "failed",
                                   f"Tool call failed ({f.kind}): {f.message}", True, None,
                                   executed=False, error=f)
            return
        is_error = bool(result.get("is_error"))
        await _finish_call(turn, pc, CallState.FAILED if is_error else CallState.OK,
                           str(result.get("outcome", "error" if is_error else "ok")),
                           result["output"], is_error, result, executed=True)
        return


async def _finish_call(turn: Turn, pc: dict[str, Any], state: CallState, outcome: str,
                       output: str, is_error: bool, result: ToolCallResult | None, *,
                       executed: bool, error: CallFailed | None = None) -> None:
    s = turn.session
    contexts: list[dict[str, Any]] = []
    if executed:  # post_tool runs only after a real execution
        folded = await s.hooks.run(HookEvent.POST_TOOL, s.sid, turn.turn_id, {
            "call_id": pc["call_id"], "name": pc["name"], "arguments": pc["arguments"],
            "output": output, "is_error": is_error})
        if folded.output is not None:
            output = folded.output
        contexts = [context_item("post_tool_hook", c) for c in folded.contexts]
    isolation = result.get("isolation") if result else None
    if isinstance(isolation, dict) and isinstance(isolation.get("tier"), str):
        tier = isolation["tier"]
        if turn.sandbox_tier is None or TIER_ORDER.get(tier, 0) < TIER_ORDER.get(
                turn.sandbox_tier, 0):
            turn.sandbox_tier = tier
    turn.tool_calls += 1
    if state is not CallState.OK:
        turn.failed_tool_calls += 1
    item: dict[str, Any] = {"type": "function_call_output", "call_id": pc["call_id"],
                            "output": output}
    if is_error:
        item["is_error"] = True
    payload: dict[str, Any] = {
        "turn_id": turn.turn_id, "call_id": pc["call_id"], "name": pc["name"],
        "output": ev.clip(output), "is_error": is_error, "outcome": outcome,
        "state": str(state), "isolation": isolation, "attempt": pc.get("attempt", 0)}
    if result is not None:
        for key in ("exit_code", "signal", "duration_s", "truncated", "error_kind"):
            if key in result:
                payload[key] = result[key]
    if error is not None:
        payload["error"] = ev.error(error.failure)

    def mutate(st: Any) -> None:
        pc["state"] = str(advance_call(CallState(pc["state"]), state))
        pc["outcome"] = outcome
        if st.active_turn is not None:
            st.active_turn = turn._active_turn(TurnPhase(st.active_turn["phase"]))
    await s.commit([(ev.TOOL_CALL_END, payload, turn.submission_id)],
                   items=[item, *contexts], execution=turn.execution("running"), mutate=mutate)
    crashpoints.reach("tool_result")


def close_open_calls(turn: Turn, message: str) -> list[dict[str, Any]]:
    """Outputs for every call an abort left open (the context stays well-formed)."""
    items = []
    for pc in turn.session.state.pending_tool_calls:
        if CallState(pc["state"]).terminal:
            continue
        was_running = pc["state"] in (CallState.DISPATCHED, CallState.STARTED)
        text = f"Tool call not completed: {message}."
        if was_running:
            text += " It was cancelled while running; its effect may be partial."
        items.append({"type": "function_call_output", "call_id": pc["call_id"],
                      "output": text, "is_error": True})
    return items
