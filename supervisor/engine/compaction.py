"""Compaction's action handlers: shrinking the context at a token threshold or
on the compact op. The turn machine (``machine.py``) runs the lifecycle; the
driver (``turn.Turn``) performs its actions with these handlers.

Lifecycle (one live notice, capability ``compaction``)::

    due? (``due``: threshold, or the compact op)        -- driver, preparing
    pre_compact hooks ── stop ──▶ warning, turn completes, nothing compacted
          │  (``begin``: the notice's block id B)
    CompactionDue(B): frontend_render pending "Context compacting", phase
          │           compacting, B stored as the turn's open notice
    Compact(B, attempt): ``run``: the route's native op "compact", or a summary
          │  through a normal model call; new context = compaction/summary item
          │  + the most recent user messages verbatim
          │  (failure: CompactionDone(failure): retried under the model call's
          │   rule, a durable warning each time; finally the turn fails and
          │   Finish completes B "Context compaction failed"; an interrupt:
          │   "... cancelled"; counts unchanged)
    post_compact hooks, session_start(source=compact) hooks ── stop ──▶
          │   CompactionDone(stop, settle): settle, warning, complete
    CompactionDone(ok): PROVISIONAL (``TurnView.provisional``, never stored)
          │  while the later preparation hooks (pre_model, model_request) run
    ``settlement`` carried by Prepared / Done: ONE commit = the rewrite (epoch+1,
    reasons [compaction]) + compaction_count+1 + usage (after the usage
    observer) + last_usage unset + cache breakpoint reset + token_count +
    context_compacted + render B complete "Context compacted"

Invariants:
- ``context_epoch`` and ``compaction_count`` change only when a compaction
  settles successfully; the notice completes exactly once, under the same
  block id, before the turn's terminal event (the machine holds it open in
  ``ActiveTurn.notice`` until the settle's commit or ``Finish.notice``).
- Exactly one ``context_compacted`` event per successful compaction (durable,
  so replay shows exactly one).
- The usage of a compaction that does not settle is not committed (it never
  passed the usage observer: ``settlement`` runs it).
"""

from __future__ import annotations

import json
from typing import Any

from broker import plants  # chaos plant switches (broker/plants.py)
from sandbox_worker.api import add_usage
from supervisor import crashpoints
from supervisor.engine import events as ev
from supervisor.engine.calls import call_model
from supervisor.engine.errors import CallFailed
from supervisor.engine.hooks import HookEvent
from supervisor.engine.machine import Compact, CompactionDone, Settle
from supervisor.engine.ports import Provisional, TurnStopped, TurnView

SUMMARY_INSTRUCTIONS = (
    "Summarize the conversation so far for your own later use: the user's goals, what was "
    "done, what was found, and what remains. Be complete but concise.")


def estimate_tokens(context: list[dict[str, Any]]) -> int:
    """A cheap, conservative token estimate (about 4 characters per token)."""
    return sum(len(json.dumps(item, default=str)) for item in context) // 4 + 1


def due(turn: TurnView) -> bool:
    """Whether the turn compacts before its next model step: the compact op, or
    the estimated context reached the threshold with something added since the
    last rewrite (never while a compaction is provisional)."""
    if turn.provisional is not None:
        return False
    if turn.force_compact:
        return True
    s = turn.session
    st = s.state
    threshold = s.spec.compaction_threshold_tokens or s.config.compaction_threshold_tokens
    if threshold is None or not s.context:
        return False
    if st.last_rewrite is not None and st.next_batch_sequence - 1 <= int(
            st.last_rewrite.get("at_batch", 0)):
        return False  # nothing was added since the last rewrite
    return estimate_tokens(s.context) >= threshold


async def begin(turn: TurnView) -> str | None:
    """The pre_compact hooks of a due compaction; its notice's block id, or None
    when there is nothing to compact (a warning). A hook's stop: ``TurnStopped``."""
    s = turn.session
    forced = turn.force_compact
    turn.force_compact = False
    if not s.context:
        await s.warn("nothing to compact: the context is empty", turn.submission_id)
        return None
    pre = await s.hooks.run(HookEvent.PRE_COMPACT, s.sid, turn.turn_id, {
        "trigger": "op" if forced else "threshold", "tokens": estimate_tokens(s.context)})
    if pre.stop is not None:
        raise TurnStopped(pre.stop)
    return ev.new_id("block")


async def run(turn: TurnView, a: Compact) -> CompactionDone:
    """``Compact``: one attempt of the compaction call (the machine retries it),
    then the post_compact and session_start hooks on the new context, which is
    provisional (``turn.provisional``) until it settles."""
    s = turn.session
    route = s.manager.route(s.route_name)
    native = bool(route.get("native_compaction"))
    items = list(s.context)
    if not native:
        items.append({"type": "message", "role": "developer",
                      "content": [{"type": "input_text", "text": SUMMARY_INSTRUCTIONS}]})
    request = {"op": "compact" if native else "respond", "route": route,
               "instructions": s.spec.instructions or s.config.instructions, "items": items,
               "tools": [], "stream": False, "session_id": s.sid, "prompt_cache_key": s.sid}
    try:
        result = await call_model(s.manager.broker, request, budget_s=a.budget_s,
                                  attempt=a.attempt, cancel_grace_s=s.config.cancel_grace_s)
    except CallFailed as f:
        return CompactionDone(False, f.failure)
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
    if recent and plants.on("compaction_drops_user"):  # chaos plant: the newest is lost
        recent = recent[:-1]
    turn.provisional = Provisional([*head, *recent], result["usage"], a.block_id)
    crashpoints.reach("compaction")
    post = await s.hooks.run(HookEvent.POST_COMPACT, s.sid, turn.turn_id,
                             {"items": len(turn.provisional.context)})
    if post.stop is not None:
        return CompactionDone(stop=post.stop, settle=await settlement(turn))
    again = await s.hooks.run(HookEvent.SESSION_START, s.sid, turn.turn_id, {"source": "compact"})
    for text in again.push_inputs:
        await s.admit(text, [], None)
    if again.stop is not None:
        return CompactionDone(stop=again.stop, settle=await settlement(turn))
    return CompactionDone()


async def settlement(turn: TurnView) -> Settle | None:
    """The provisional compaction's commit, for the machine to make (``Settle``):
    the usage observer first (it may veto: ``UsageObserverFailed``). None when
    no compaction is provisional."""
    s = turn.session
    p = turn.provisional
    if p is None:
        return None
    await s.manager.observe_usage(s.route_name, p.usage)
    turn.usage = add_usage(turn.usage, p.usage)
    total = dict(add_usage(s.state.total_usage, p.usage))  # type: ignore[arg-type]
    route = s.manager.route(s.route_name)
    new = tuple(p.context)

    def write(st: Any) -> None:
        st.compaction_count += 1
        st.total_usage = dict(add_usage(st.total_usage, p.usage))
        st.last_usage = None
        st.last_rewrite = {"epoch": st.context_epoch + 1, "reasons": ["compaction"],
                           "at_batch": st.next_batch_sequence - 1, "reported": False}
        st.cache_breakpoint = len(new) - 1 if new else None
    epoch = s.state.context_epoch + 1
    return Settle((
        (ev.TOKEN_COUNT, {"turn_id": turn.turn_id, "last": dict(p.usage), "total": total,
                          "context_window": route.get("context_window")}),
        (ev.CONTEXT_COMPACTED, {"turn_id": turn.turn_id, "epoch": epoch,
                                "reasons": ["compaction"], "items": len(new)}),
        (ev.FRONTEND_RENDER, ev.render_block(p.block_id, ev.COMPACTED_TITLE, complete=True)),
    ), new, write)


async def close_notice(turn: TurnView, block: str, outcome: str) -> None:
    """``Finish.notice``: complete an open notice as failed or cancelled; the
    provisional compaction is dropped."""
    s = turn.session
    turn.provisional = None
    title = ev.COMPACTION_CANCELLED_TITLE if outcome == "cancelled" \
        else ev.COMPACTION_FAILED_TITLE
    await s.commit([(ev.FRONTEND_RENDER, ev.render_block(block, title, complete=True),
                     turn.submission_id)])
