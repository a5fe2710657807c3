"""Compaction: shrinking the context at a token threshold or on the compact op.

Lifecycle (one live notice, capability ``compaction``)::

    pre_compact hooks ── stop ──▶ warning, turn completes, nothing compacted
          │
    frontend_render pending "Context compacting" (block id B)
          │
    compaction call: the route's native op "compact", or a summary through a
    normal model call; new context = compaction/summary item + the most recent
    user messages verbatim
          │  (failure / interrupt ──▶ render B complete "Context compaction
          │   failed" / "... cancelled"; counts unchanged)
    post_compact hooks, session_start(source=compact) hooks ── stop ──▶ settle,
          │                                                    warning, complete
    PROVISIONAL: held in memory while the later preparation hooks (pre_model,
    model_request) run against it
          │
    settle: ONE commit = ContextRewrite(epoch+1, reasons [compaction]) +
    compaction_count+1 + usage (after the usage observer) + last_usage unset +
    cache breakpoint reset + token_count + context_compacted + render B
    complete "Context compacted"

Invariants:
- ``context_epoch`` and ``compaction_count`` change only when a compaction
  settles successfully; the notice completes exactly once, under the same
  block id, before the turn's terminal event.
- Exactly one ``context_compacted`` event per successful compaction (durable,
  so replay shows exactly one).
- The usage of a compaction that does not settle is not committed (it never
  passed the usage observer).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from sandbox_worker.api import ModelCallResult, add_usage
from supervisor import crashpoints
from supervisor.engine import events as ev
from supervisor.engine.calls import call_model
from supervisor.engine.errors import CallFailed, ModelCallFailed
from supervisor.engine.hooks import HookEvent
from supervisor.engine.machine import retries
from supervisor.engine.phases import TurnPhase
from supervisor.engine.ports import Provisional, TurnStopped, TurnView

SUMMARY_INSTRUCTIONS = (
    "Summarize the conversation so far for your own later use: the user's goals, what was "
    "done, what was found, and what remains. Be complete but concise.")


def estimate_tokens(context: list[dict[str, Any]]) -> int:
    """A cheap, conservative token estimate (about 4 characters per token)."""
    return sum(len(json.dumps(item, default=str)) for item in context) // 4 + 1


def _due(turn: TurnView) -> bool:
    s = turn.session
    st = s.state
    threshold = s.spec.compaction_threshold_tokens or s.config.compaction_threshold_tokens
    if threshold is None or not s.context:
        return False
    if st.last_rewrite is not None and st.next_batch_sequence - 1 <= int(
            st.last_rewrite.get("at_batch", 0)):
        return False  # nothing was added since the last rewrite
    return estimate_tokens(s.context) >= threshold


async def maybe_compact(turn: TurnView) -> None:
    s = turn.session
    forced = turn.force_compact
    if not forced and not _due(turn):
        return
    turn.force_compact = False
    if not s.context:
        await s.warn("nothing to compact: the context is empty", turn.submission_id)
        return
    pre = await s.hooks.run(HookEvent.PRE_COMPACT, s.sid, turn.turn_id, {
        "trigger": "op" if forced else "threshold", "tokens": estimate_tokens(s.context)})
    if pre.stop is not None:
        raise TurnStopped(pre.stop)
    block = ev.new_id("block")
    turn.open_block = block
    await s.commit([(ev.FRONTEND_RENDER, ev.render_block(block, ev.COMPACTING_TITLE,
                                                         complete=False), turn.submission_id)],
                   mutate=turn.moving_to(TurnPhase.COMPACTING))
    route = s.manager.route(s.route_name)
    native = bool(route.get("native_compaction"))
    items = list(s.context)
    if not native:
        items.append({"type": "message", "role": "developer",
                      "content": [{"type": "input_text", "text": SUMMARY_INSTRUCTIONS}]})
    request = {"op": "compact" if native else "respond", "route": route,
               "instructions": s.spec.instructions or s.config.instructions, "items": items,
               "tools": [], "stream": False, "session_id": s.sid, "prompt_cache_key": s.sid}
    result = await _compaction_call(turn, request)
    if native:
        head = [i for i in result["items"] if i.get("type") == "compaction"] or result["items"]
    else:
        text = "".join(ev.message_text(i) for i in result["items"] if i.get("type") == "message")
        head = [{"type": "compaction", "summary": text}]
    keep = s.config.compaction_keep_recent
    # Recent user messages stay verbatim (assistant output is what the compaction
    # item summarises; keeping it too would double-count model outputs).
    recent = [i for i in s.context if i.get("type") == "message" and i.get("role") == "user"
              and not (i.get("corral") or {}).get("kind")][-keep:] if keep else []
    turn.provisional = Provisional([*head, *recent], result["usage"], block)
    crashpoints.reach("compaction")
    post = await s.hooks.run(HookEvent.POST_COMPACT, s.sid, turn.turn_id,
                             {"items": len(turn.provisional.context)})
    if post.stop is not None:
        await settle(turn, "success")
        raise TurnStopped(post.stop)
    again = await s.hooks.run(HookEvent.SESSION_START, s.sid, turn.turn_id, {"source": "compact"})
    for text in again.push_inputs:
        await s.admit(text, [], None)
    if again.stop is not None:
        await settle(turn, "success")
        raise TurnStopped(again.stop)
    await s.commit(mutate=turn.moving_to(TurnPhase.PREPARING))


async def _compaction_call(turn: TurnView, request: dict[str, Any]) -> ModelCallResult:
    """The compaction request, retried as a model call is (``machine.retries``: a
    lost worker or a retryable failure, up to ``model_attempts``, each attempt
    with what is left of the turn's budget); each retry is a durable warning
    ``{compaction_retry: {attempt, error}}`` while the notice stays pending."""
    s = turn.session
    cfg = s.config
    attempt = 1
    while True:
        try:
            return await call_model(s.manager.broker, request,
                                    budget_s=turn.budget_s(cfg.model_call_budget_s),
                                    attempt=attempt, cancel_grace_s=cfg.cancel_grace_s)
        except CallFailed as f:
            if not retries(f.failure, attempt, cfg.model_attempts):
                raise ModelCallFailed(f"compaction failed: {f.kind}: {f.message}",
                                      kind=f.kind, retryable=f.retryable) from f
            await s.warn(f"the compaction call failed ({f.kind}: {ev.clip(f.message, 500)}); "
                         f"trying again (attempt {attempt + 1} of {cfg.model_attempts})",
                         turn.submission_id,
                         compaction_retry={"attempt": attempt, "error": ev.error(f.failure)})
            attempt += 1
            await asyncio.sleep(cfg.model_retry_delay_s * attempt)


async def settle(turn: TurnView, outcome: str) -> None:
    """Make a provisional compaction durable (``outcome == "success"``)."""
    s = turn.session
    p = turn.provisional
    if p is None or outcome != "success":
        await close_notice(turn, outcome)
        return
    await s.manager.observe_usage(s.route_name, p.usage)
    turn.usage = add_usage(turn.usage, p.usage)
    total = dict(add_usage(s.state.total_usage, p.usage))  # type: ignore[arg-type]
    route = s.manager.route(s.route_name)

    def mutate(st: Any) -> None:
        st.compaction_count += 1
        st.total_usage = dict(add_usage(st.total_usage, p.usage))
        st.last_usage = None
        st.last_rewrite = {"epoch": st.context_epoch + 1, "reasons": ["compaction"],
                           "at_batch": st.next_batch_sequence - 1, "reported": False}
        st.cache_breakpoint = len(p.context) - 1 if p.context else None
        if st.active_turn is not None:
            st.active_turn = turn.checkpoint_turn(TurnPhase(st.active_turn["phase"]))
    epoch = s.state.context_epoch + 1
    await s.commit([
        (ev.TOKEN_COUNT, {"turn_id": turn.turn_id, "last": dict(p.usage), "total": total,
                          "context_window": route.get("context_window")}, turn.submission_id),
        (ev.CONTEXT_COMPACTED, {"turn_id": turn.turn_id, "epoch": epoch,
                                "reasons": ["compaction"], "items": len(p.context)},
         turn.submission_id),
        (ev.FRONTEND_RENDER, ev.render_block(p.block_id, ev.COMPACTED_TITLE, complete=True),
         turn.submission_id),
    ], rewrite=(p.context, ["compaction"]), execution=turn.execution("running"), mutate=mutate)
    turn.provisional = None
    turn.open_block = None


async def close_notice(turn: TurnView, outcome: str) -> None:
    """Close an open notice as failed or cancelled; the compaction is discarded."""
    s = turn.session
    block = turn.open_block
    turn.provisional = None
    turn.open_block = None
    if block is None:
        return
    title = ev.COMPACTION_CANCELLED_TITLE if outcome == "cancelled" \
        else ev.COMPACTION_FAILED_TITLE
    await s.commit([(ev.FRONTEND_RENDER, ev.render_block(block, title, complete=True),
                     turn.submission_id)])
