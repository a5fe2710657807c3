"""Export at tool boundaries (the A3S checkpoint-export behaviour).

After each completed tool round of a turn (a "tool boundary"), once the
store's write for that round is committed, the engine builds one portable
checkpoint (``supervisor.export.build_checkpoint``) and hands it to every
configured export sink, in order.

Order at a boundary:
1. the round's last step is already committed (outputs, pending calls cleared);
2. ``CheckpointState.export_loop_checkpoint`` := ``loop_reference(doc)``,
   committed: a small reference (digest, run snapshot, event range and the
   context position; never the context itself, the state row stays bounded)
   from which ``supervisor.export.load_loop_checkpoint`` rebuilds exactly the
   exported document: during the export the store holds exactly the exported
   logical checkpoint;
3. each sink is awaited (bounded by ``EngineConfig.export_timeout_s``);
4. when the turn ends (complete, aborted or failed) the loop checkpoint is
   cleared in the turn's final commit.

Invariants:
- A failing or slow sink never halts the run: its failure becomes a durable
  ``warning`` event carrying ``{"export": {sink, kind, message, retryable,
  digest, turn}}`` (the record), and the turn goes on.
- The run is the turn (``run_id`` = turn id); ``turn`` counts the tool rounds
  of that run (1, 2, ...); the run's events are the turn's durable events.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from broker import plants  # chaos plant switches (broker/plants.py)
from broker.protocol import Failed, Failure
from supervisor.engine import events as ev
from supervisor.engine.ports import TurnView
from supervisor.engine.tooling import session_binding
from supervisor.export.checkpoint import build_checkpoint
from supervisor.export.resume import loop_reference
from supervisor.store.records import EventRecord

log = logging.getLogger(__name__)

MAX_RUN_EVENTS = 20_000


async def _run_events(turn: TurnView) -> list[EventRecord]:
    s = turn.session
    out: list[EventRecord] = []
    after = turn.first_sequence - 1
    while len(out) < MAX_RUN_EVENTS:
        page = await s.manager.store.events_page(s.sid, after_sequence=after, limit=500)
        out.extend(page.items)
        if page.next_cursor is None or not page.items:
            break
        after = page.items[-1].sequence
    return out


def _sink_name(sink: Any) -> str:
    return str(getattr(sink, "name", None) or type(sink).__name__)


async def _call_sink(sink: Any, doc: dict[str, Any]) -> None:
    export = getattr(sink, "export", None) or getattr(sink, "export_checkpoint", None)
    if export is None:
        raise TypeError(f"{_sink_name(sink)} has no export method")
    result = export(doc)
    if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
        await result


def _failure_of(exc: Exception, timeout_s: float) -> Failure:
    """A sink's failure as data: its own when it raised a ``Failed`` (``SinkError``),
    else a timeout or a generic ``sink_error`` (never the exception's class name)."""
    if isinstance(exc, Failed):
        return exc.failure
    if isinstance(exc, TimeoutError):
        return Failure("timeout", f"the sink took longer than {timeout_s:g}s", True)
    return Failure("sink_error", str(exc) or "the sink failed", True)


async def export_boundary(turn: TurnView, call_ids: list[str]) -> None:
    s = turn.session
    sinks = s.manager.export_sinks
    if not sinks:
        return
    st = s.state
    events = await _run_events(turn)
    binding = session_binding(s.spec)
    doc = build_checkpoint(
        session_id=s.sid, run_id=turn.turn_id, turn=len(turn.tool_rounds),
        messages=_without_last_said(s.context) if plants.on("export_drops_message")  # plant
        else s.context, usage={k: int(v) for k, v in turn.usage.items()},  # type: ignore[call-overload]
        binding=binding,
        tool_rounds=turn.tool_rounds, execution=turn.execution("running"), events=events,
        epoch=st.context_epoch, at_batch=st.next_batch_sequence - 1)
    reference = loop_reference(doc)

    def hold(state: Any) -> None:
        state.export_loop_checkpoint = reference
    await s.commit(mutate=hold)
    for sink in sinks:
        name = _sink_name(sink)
        try:
            async with asyncio.timeout(s.config.export_timeout_s):
                await _call_sink(sink, doc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a sink is host code: its failure is data, never a halt
            log.warning("session %s: export to %s failed: %s", s.sid, name, exc)
            failure = _failure_of(exc, s.config.export_timeout_s)
            await s.warn(f"checkpoint export to {name} failed", turn.submission_id, export={
                "sink": name, "kind": failure.kind, "message": ev.clip(failure.message, 2000),
                "retryable": failure.retryable,
                "digest": doc["descriptor"]["digest"], "turn": len(turn.tool_rounds),
                "run_id": turn.turn_id})


def _without_last_said(context: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chaos plant ``export_drops_message``: the context less its newest assistant
    message (a transcript that still verifies, its calls and outputs intact)."""
    said = [i for i, m in enumerate(context)
            if m.get("type") == "message" and m.get("role") == "assistant"]
    return [m for i, m in enumerate(context) if not said or i != said[-1]]
