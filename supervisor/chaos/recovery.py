"""Recovery times of the sessions a fault really hit, from what clients saw live.

Pure: works on each session's live log (``(receive_time, event)`` pairs, the
receive time from ``time.monotonic()``) and, per fault, the instant it fired
and how far each session's log had got at that instant (``mark``).

Which sessions a fault *affected* (had work on the killed process):

- a worker kill or hang that targeted the ``model`` service: sessions with a
  model step open at the fault whose step then ended with a ``worker_lost``
  error (the engine saw the stream lost and retried it);
- one that targeted ``tool``: sessions with a tool call open at the fault
  whose ``tool_call_end`` carries a ``worker_lost`` error (``unknown``);
  for both, other sessions open in the same phase ran on other workers and
  finished normally, so they are not counted;
- the broker: sessions with a model step or tool call open (in flight
  through the broker) at the fault;
- the scripted provider: sessions with a model step open at the fault whose
  step then ended ``retrying`` (its stream or connection broke);
- the supervisor: sessions with a turn running at the fault; on a farm of several
  supervisors, only among the sessions the killed one owned (``only``, from the
  leases table at the kill; for a crash point, the rows naming its claimer, read
  right after the claim);
- a supervisor stopped past its lease (``takeover``): the sessions it owned with a
  turn running; their next progress comes from the supervisor that took them over;
- PostgreSQL restarted (``store``): sessions with a turn running.

Recovery time: from the fault to the affected session's next progress
event, a durable event received after the fault that is not the report of
the loss itself (for worker and provider faults, the first durable event
after the loss report; otherwise the first durable event after the fault).

Invariant: an affected session that never progressed is counted in
``unrecovered``, never silently left out.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

LiveLog = list[tuple[float, dict[str, Any]]]


@dataclass
class OpenWork:
    """What one session had in progress, as its client had seen it."""

    turn_running: bool = False
    model_step: int | None = None
    tool_calls: set[str] = field(default_factory=set)


def open_work(live: LiveLog, upto: int) -> OpenWork:
    w = OpenWork()
    for _, e in live[:upto]:
        if e.get("sequence", 0) <= 0:
            continue
        t, p = e.get("type"), e.get("payload") or {}
        if t == "turn_started":
            w = OpenWork(turn_running=True)
        elif t in ("turn_complete", "turn_aborted"):
            w = OpenWork()
        elif t == "model_step_started":
            w.model_step = p.get("step")
        elif t == "model_step_completed" and p.get("step") == w.model_step:
            w.model_step = None
        elif t == "tool_call_begin":
            w.tool_calls.add(str(p.get("call_id")))
        elif t == "tool_call_end":
            w.tool_calls.discard(str(p.get("call_id")))
    return w


@dataclass
class FaultMark:
    """A fired fault: its recovery group, its instant, and each session's log length."""

    group: str  # worker | broker | supervisor | provider | takeover | store
    at: float
    service: str | None  # worker faults: the service the target had in flight
    marks: dict[str, int]  # session id -> len(live) at the fault
    only: frozenset[str] | None = None  # the sessions it can hit (a supervisor's own)


def _durable_after(live: LiveLog, start: int, at: float) -> list[tuple[float, dict[str, Any]]]:
    return [(t, e) for t, e in live[start:] if e.get("sequence", 0) > 0 and t >= at]


def _loss_report(after: list[tuple[float, dict[str, Any]]], work: OpenWork,
                 service: str) -> int | None:
    """Index in ``after`` of the event reporting that the open work was lost."""
    for i, (_, e) in enumerate(after):
        p = e.get("payload") or {}
        if (service == "tool" and e.get("type") == "tool_call_end"
                and str(p.get("call_id")) in work.tool_calls):
            if _lost(p.get("error")):
                return i
        elif (service == "model" and e.get("type") == "model_step_completed"
              and p.get("step") == work.model_step):
            return i if _lost((p.get("diagnostics") or {}).get("error")) else None
        elif (service == "provider" and e.get("type") == "model_step_completed"
              and p.get("step") == work.model_step):
            return i if p.get("outcome") == "retrying" else None
        elif e.get("type") in ("turn_complete", "turn_aborted"):
            return None
    return None


def _lost(error: Any) -> bool:
    """The failure says the worker was lost (not a provider retry or a deadline)."""
    return isinstance(error, dict) and error.get("kind") == "worker_lost"


def affected(fault: FaultMark, lives: dict[str, LiveLog]) -> dict[str, float | None]:
    """Affected session id -> recovery seconds (None: it never progressed)."""
    out: dict[str, float | None] = {}
    for sid, mark in fault.marks.items():
        if fault.only is not None and sid not in fault.only:
            continue
        live = lives.get(sid, [])
        work = open_work(live, mark)
        after = _durable_after(live, mark, fault.at)
        if fault.group == "worker":
            services = {"model": ["model"], "tool": ["tool"],
                        "mixed": ["model", "tool"]}.get(fault.service or "", [])
            found = [_loss_report(after, work, svc) for svc in services
                     if (work.model_step is not None if svc == "model"
                         else bool(work.tool_calls))]
            hits = [i for i in found if i is not None]
            if not hits:
                continue
            i = min(hits)
            nxt = after[i + 1:i + 2]
            out[sid] = nxt[0][0] - fault.at if nxt else None
            continue
        if fault.group == "provider":
            j = _loss_report(after, work, "provider") if work.model_step is not None else None
            if j is not None:
                nxt = after[j + 1:j + 2]
                out[sid] = nxt[0][0] - fault.at if nxt else None
            continue
        if fault.group == "broker":
            hit = work.model_step is not None or bool(work.tool_calls)
        else:
            hit = work.turn_running
        if hit:
            out[sid] = after[0][0] - fault.at if after else None
    return out


def summarize(times: list[float]) -> dict[str, Any]:
    if not times:
        return {"count": 0, "p50_s": None, "p99_s": None, "max_s": None}
    s = sorted(times)
    p99 = s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]
    return {"count": len(s), "p50_s": round(statistics.median(s), 3),
            "p99_s": round(p99, 3), "max_s": round(s[-1], 3)}
