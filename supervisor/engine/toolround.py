"""The tool round's action handlers: the function calls of one model step
from the model's reply to an output each. The turn machine (``machine.py``)
decides the round (which calls run, are denied or asked, what a lost call
becomes, when the round ends); the driver (``turn.Turn.feed``) performs its
actions with these handlers and feeds their results back as events:

- ``prepare_calls``: the model's calls as ``CallSpec`` records (ids made
  unique, arguments parsed and bounded, missing tools, pre_tool hooks);
- ``decide`` (``Decide`` -> ``Decided``): the approval policy, then
  permission hooks;
- ``await_approval`` (``AskApproval`` -> ``ApprovalAnswered``);
- ``run_call`` (``CallTool`` -> ``ToolStarted``, then ``ToolReplied`` with the
  output as the post_tool hooks left it, or ``ToolFailed``).

Order of what enters the context (the möbius ordering the tests pin):
``[assistant items..., pre_tool contexts..., function_call...]`` in the model
step's commit, then each call's ``function_call_output`` — followed directly by
its ``post_tool`` context when (and only when) the call really executed — in
completion order, one commit per completed call.

Worker-loss rules:
- A call whose worker is lost is never re-run silently: outcome ``unknown``,
  and the model reads that the worker was lost and the effect is unknown.
  Only tools that say they are idempotent (``tooling.idempotent_in``, recorded
  in the call's ``PendingCall``) are re-dispatched (bounded attempts).
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
  (the machine's ``Finish`` closes what an interrupt or failure left open).
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
from dataclasses import replace
from typing import Any

from sandbox_worker.api import ModelCallResult, json_size, replace_surrogates
from supervisor.engine import bounds
from supervisor.engine import events as ev
from supervisor.engine.approvals import Decision
from supervisor.engine.calls import call_tool
from supervisor.engine.errors import CallFailed
from supervisor.engine.hooks import HookEvent, context_item
from supervisor.engine.machine import (
    CallSpec,
    CallTool,
    Decided,
    Event,
    EventSpec,
    ToolFailed,
    ToolReplied,
    ToolStarted,
    TurnState,
    Verdict,
)
from supervisor.engine.ports import TurnView
from supervisor.engine.session import PendingApproval
from supervisor.engine.tooling import base_request, idempotent_in, offered_in, outside_request

log = logging.getLogger(__name__)

# (event, acknowledged once the driver performed what it led to, or None)
Results = asyncio.Queue[tuple[Event, "asyncio.Future[None] | None"]]


async def prepare_calls(turn: TurnView, result: ModelCallResult
                        ) -> tuple[list[CallSpec], list[dict[str, Any]], list[dict[str, Any]],
                                   list[EventSpec]]:
    """The model's function calls as the machine takes them, after pre_tool hooks:
    (calls, their function_call items, the pre_tool contexts, the warnings to
    commit after the step: dropped calls, renamed call ids)."""
    s = turn.session
    calls = [i for i in result["items"] if i.get("type") == "function_call"]
    specs: list[CallSpec] = []
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
        items.append({"type": "function_call", "call_id": call_id, "name": name,
                      "arguments": text})
        # undecided (None) until the approval policy runs (``decide``)
        spec = CallSpec(call_id, name, args or {}, None, None, idempotent_in(s, name))
        if problem is not None:
            spec = replace(spec, verdict=Verdict.BAD, reason=problem)
        elif not offered_in(s, name):
            spec = replace(spec, verdict=Verdict.MISSING, reason=(
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
                    spec = replace(spec, verdict=Verdict.BAD, arguments={}, reason=(
                        f"a pre_tool hook rewrote the arguments: {why or 'too large'}"))
                else:
                    spec = replace(spec, arguments=rewritten)
                    budget -= grown
            if folded.deny is not None:
                spec = replace(spec, verdict=Verdict.DENY, reason=(  # lives in the state row
                    f"denied by a pre_tool hook: {ev.clip(str(folded.deny), 4096)}"))
        specs.append(spec)
    notices: list[EventSpec] = []
    if dropped:
        notices.append((ev.WARNING, ev.warning(
            f"the model asked for {len(calls) + len(dropped)} tool calls in one step; "
            f"the {len(dropped)} after the first {bounds.MAX_CALLS_PER_STEP} were dropped",
            dropped_calls=len(dropped))))
    for old, fresh, in_step in renamed:
        what = ("to more than one call in one step; the later call" if in_step else
                "that an earlier call in the session's context has; this call")
        notices.append((ev.WARNING, ev.warning(
            f"the model gave call_id {old[:100]!r} {what} runs as {fresh!r}",
            call_id=old[:200], renamed_to=fresh)))
    return specs, items, contexts, notices


async def decide(turn: TurnView, state: TurnState, call_ids: tuple[str, ...]) -> Decided:
    """The approval policy, then permission hooks, for the calls not yet decided;
    what is still undecided is asked (``Verdict.ASK``) under a fresh approval id."""
    s = turn.session
    approved = frozenset(s.state.approved_for_session)
    verdicts: list[tuple[str, Verdict, str | None]] = []
    ask: list[tuple[str, str, dict[str, Any], str]] = []  # (call_id, name, arguments, reason)
    for call_id in call_ids:
        pc = state.call(call_id)
        if pc is None:
            continue
        decision, reason = s.policy.decide(pc.name, dict(pc.arguments), approved)
        if decision is Decision.ALLOW:
            verdicts.append((call_id, Verdict.ALLOW, reason))
        elif decision is Decision.DENY:
            verdicts.append((call_id, Verdict.DENY, reason))
        else:
            ask.append((call_id, pc.name, dict(pc.arguments), reason))
    joined = "; ".join(r for *_, r in ask)
    if ask:
        summary = [{"call_id": cid, "name": name, "arguments": args}
                   for cid, name, args, _ in ask]
        folded = await s.hooks.run(HookEvent.PERMISSION_REQUEST, s.sid, turn.turn_id,
                                   {"calls": summary, "reason": joined})
        if folded.deny is not None:  # any deny wins; no later allow can weaken it
            verdicts += [(cid, Verdict.DENY, (
                f"denied by a permission hook: {ev.clip(str(folded.deny), 4096)}"))
                for cid, *_ in ask]
            ask = []
        elif folded.allow:
            verdicts += [(cid, Verdict.ALLOW, "allowed by a permission hook")
                         for cid, *_ in ask]
            ask = []
    verdicts += [(cid, Verdict.ASK, reason) for cid, _, _, reason in ask]
    return Decided(tuple(verdicts), ev.new_id("approval") if ask else "", joined)


async def await_approval(turn: TurnView, approval_id: str,
                         requested_at: float | None) -> tuple[str, PendingApproval]:
    """Wait for the user's answer to an open approval request (``requested_at``:
    the stored time of its ``exec_approval_request``, when this process made it
    or a resumed turn found it); the answer and its waiter (whose ``applied`` the
    driver resolves once the answer's verdicts are committed)."""
    s = turn.session
    waiter = s.approval
    if waiter is None or waiter.approval_id != approval_id:
        waiter = PendingApproval(approval_id, turn.turn_id)
        s.approval = waiter
    if waiter.requested_at is None and waiter.requested_mono is None:
        waiter.requested_at = requested_at
    timeout_s = s.config.approval_timeout_s
    left_s = timeout_s
    if timeout_s is not None:
        elapsed_s = waiter.elapsed_s()
        if elapsed_s is None:  # its event is beyond the resume scan: count from now
            log.warning("session %s: approval %s: request time unknown; its timeout "
                        "counts from now", s.sid, approval_id)
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
    return decision, waiter


def acknowledge(waiter: PendingApproval) -> None:
    """The answer's submit returns now (its verdicts are committed, or the turn
    ended without them)."""
    if not waiter.applied.done():
        waiter.applied.set_result(None)


async def run_call(turn: TurnView, call: CallTool, results: Results) -> None:
    """Perform one ``CallTool``: its first output is ``ToolStarted`` (the
    delta is shown once that state is committed), its answer ``ToolReplied``
    after the post_tool hooks, a failure ``ToolFailed``."""
    s = turn.session
    cfg = s.config
    call_id = call.call_id
    started = False

    async def on_partial(chunk: Any) -> None:
        nonlocal started
        if not started:
            started = True
            committed = asyncio.get_running_loop().create_future()
            await results.put((ToolStarted(call_id), committed))
            await committed
        if isinstance(chunk, dict):
            data = chunk.get("data", b"")
            text = data.decode("utf-8", "replace") if isinstance(data, bytes) else str(data)
            s.publish_live(ev.TOOL_CALL_OUTPUT_DELTA, {
                "turn_id": turn.turn_id, "call_id": call_id,
                "stream": chunk.get("stream", "stdout"), "text": text[:65536]},
                turn.submission_id)

    request = outside_request(s, base_request(s, call_id, call.name, dict(call.arguments)))
    try:
        result = await call_tool(s.manager.broker, request, budget_s=call.budget_s,
                                 attempt=call.attempt, on_partial=on_partial,
                                 cancel_grace_s=cfg.cancel_grace_s)
    except CallFailed as f:
        await results.put((ToolFailed(call_id, f.failure), None))
        return
    is_error = bool(result.get("is_error"))
    output = result["output"]
    # post_tool runs only after a real execution
    folded = await s.hooks.run(HookEvent.POST_TOOL, s.sid, turn.turn_id, {
        "call_id": call_id, "name": call.name, "arguments": dict(call.arguments),
        "output": output, "is_error": is_error})
    if folded.output is not None:
        output = folded.output
    isolation = result.get("isolation")
    tier = isolation.get("tier") if isinstance(isolation, dict) else None
    turn.note_tier(tier if isinstance(tier, str) else None)
    details: dict[str, Any] = {"isolation": isolation}
    for key in ("exit_code", "signal", "duration_s", "truncated", "error_kind"):
        if key in result:
            details[key] = result[key]
    await results.put((ToolReplied(
        call_id, is_error, str(result.get("outcome", "error" if is_error else "ok")), output,
        details, tuple(context_item("post_tool_hook", c) for c in folded.contexts)), None))
