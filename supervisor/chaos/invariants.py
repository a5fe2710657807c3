"""The chaos harness's invariants, checked after the farm is down.

Each check returns ``Violation``s naming the invariant, the session and the
event sequence where it first fails. Inputs are facts, never assumptions:
the events clients saw live, the durable store (opened after the farm
stopped), the marker files in each workspace, the export files and the pids
of every process the farm ever ran.

The invariants (issue 7):
1. ``turn_ends_once``: every submitted turn ends exactly once, complete or
   aborted with a reason.
2. ``not_wedged``: each session accepted and completed a turn after the
   faults stopped.
3. ``one_output_per_call``: every function call in every context has exactly
   one output, and no output lacks its call.
4. ``effect_at_most_once``: no non-idempotent tool effect happened more
   often than the script asks for it (once; markers counted on disk); no
   non-idempotent call is dispatched a second time (``attempt`` > 1); the
   model is never asked for a marker more often than the script asks; every
   ``ok`` call's effect is on disk.
5. ``unknown_reported``: an effect on disk whose call did not end ``ok`` was
   reported as ``unknown`` (or as a failure that may have run), never as
   "not run"; an effect with no ``tool_call_end`` at all is a violation; a
   call running on a worker that was killed or hung (its cgroup, read at the
   kill) ends ``unknown`` with ``worker_lost`` within the liveness window
   plus a margin.
6. ``replay_equals_live``: the durable events replayed from the store equal
   what clients saw live, with no gap or duplicate in the sequences.
7. ``exports_verify``: every exported checkpoint verifies, and a copy with
   any one section tampered with does not (``exportcheck.py``).
8. ``no_orphans``: no process outlives the farm's shutdown, and a long
   call's processes are gone soon after the call ends (``orphans_seen``).
9. ``recovery_accounted``: a worker fault that hit a worker holding requests
   affected some session, or the evidence explains why not (the harness).
10. ``faults_reached``: in a run at least ``schedule.coverage_s`` long, every
   enabled timed fault kind was injected (the harness).
11. ``approvals_kept``: every approval is requested once (one
   ``exec_approval_request`` per id, no call asked in two), and the answer the
   user (the harness) gave is the one applied: an approved call is not denied
   (nor left to the approval timeout), a denied one never dispatched.
12. ``compaction_once``: each compaction settles once: the ``context_compacted``
   epochs rise by one each, and the store's ``compaction_count`` equals the
   number of ``context_compacted`` events (a crash in a compaction, before it
   settles, leaves nothing; its redo is the only one).
13. ``fencing`` (several supervisors on PostgreSQL): a session's events, read from
   the disk with the lease (owner, epoch) each was written under, never go back to
   an older epoch, each epoch has one owner, no event carries an epoch the lease
   never reached, and none after the first leased one lacks a lease: a supervisor
   that lost a session published nothing under its old lease after the new owner's.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psutil

from sandbox_worker.api import worker_cgroup_dirs
from supervisor.engine.events import message_text

LiveLog = list[tuple[float, dict[str, Any]]]

ALL_CHECKS = ("turn_ends_once", "not_wedged", "one_output_per_call", "effect_at_most_once",
              "unknown_reported", "replay_equals_live", "exports_verify", "no_orphans",
              "recovery_accounted", "faults_reached", "approvals_kept", "compaction_once",
              "fencing", "usage_accounted", "transcript_complete", "export_matches_store",
              "outputs_match_calls")
# Only with several supervisors on PostgreSQL (the events record their lease there).
LEASE_CHECKS = ("fencing",)
# These count the scripted workload's markers on disk; a real model improvises.
MARKER_CHECKS = ("effect_at_most_once", "unknown_reported", "outputs_match_calls")
MARKER_ARG_RE = re.compile(r"echo m-(\d+) >> effects\.log")
MAY_HAVE_RUN = {"unknown", "timeout", "cancelled", "error", "failed", "aborted"}


@dataclass(frozen=True)
class Violation:
    invariant: str
    session_id: str
    sequence: int | None
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {"invariant": self.invariant, "session_id": self.session_id,
                "sequence": self.sequence, "detail": self.detail}


def turn_ends_once(sid: str, submissions: list[str],
                   replay: list[dict[str, Any]]) -> list[Violation]:
    out: list[Violation] = []
    ends: Counter[str] = Counter()
    first_seq: dict[str, int] = {}
    for e in replay:
        if e["type"] in ("turn_complete", "turn_aborted") and e.get("submission_id"):
            ends[e["submission_id"]] += 1
            first_seq.setdefault(e["submission_id"], e["sequence"])
            if e["type"] == "turn_aborted" and not e["payload"].get("reason"):
                out.append(Violation("turn_ends_once", sid, e["sequence"],
                                     "turn_aborted without a reason"))
    for sub in submissions:
        if ends[sub] != 1:
            out.append(Violation("turn_ends_once", sid, first_seq.get(sub),
                                 f"submission {sub} ended {ends[sub]} times"))
    return out


def one_output_per_call(sid: str, items: list[dict[str, Any]]) -> list[Violation]:
    calls = Counter(i["call_id"] for i in items if i.get("type") == "function_call")
    outputs = Counter(i["call_id"] for i in items if i.get("type") == "function_call_output")
    out = []
    for call_id in sorted(set(calls) | set(outputs)):
        if calls[call_id] != 1 or outputs[call_id] != 1:
            out.append(Violation("one_output_per_call", sid, None,
                                 f"call {call_id}: {calls[call_id]} call item(s), "
                                 f"{outputs[call_id]} output item(s)"))
    return out


def silent_timeouts(sid: str, replay: list[dict[str, Any]],
                    models: bool = False) -> list[Violation]:
    """Invariant 5 when no fault can drop a message (``frame_drop`` off): a tool
    call that ends on its deadline (error ``timeout``) lost its request or its
    answer with nothing to say so: a lost call must end ``unknown`` with
    ``worker_lost``, never be left to time out. (The workload's calls all end
    well within the 10 s budget; a hung worker is expired by liveness.) With
    ``models`` (no ``provider_hang`` either: the only fault that keeps a model
    answer past its deadline), a model step attempt that ended on its deadline
    is one too (its retry hides it from the turn, not from the checker)."""
    out = [Violation("unknown_reported", sid, e["sequence"],
                     f"tool call {e['payload'].get('call_id')} ended on its deadline "
                     "(timeout) though no fault could drop its messages: a lost request "
                     "left to time out")
           for e in replay if e["type"] == "tool_call_end"
           and ((e["payload"].get("error") or {}).get("kind") == "timeout")]
    if models:
        out += [Violation("unknown_reported", sid, e["sequence"],
                          f"model step {e['payload'].get('step')} of turn "
                          f"{e['payload'].get('turn_id')} ended on its deadline (timeout) "
                          "though no fault could drop or hold its messages: a lost "
                          "request left to time out")
                for e in replay if e["type"] == "model_step_completed"
                and (((e["payload"].get("diagnostics") or {}).get("error") or {})
                     .get("kind") == "timeout")]
    return out


def _marker_calls(replay: list[dict[str, Any]]) -> dict[str, int]:
    """call id -> marker k, for the shell calls of the workload."""
    out: dict[str, int] = {}
    for e in replay:
        p = e["payload"]
        if e["type"] == "tool_call_begin" and p.get("name") == "shell":
            m = MARKER_ARG_RE.search(json.dumps(p.get("arguments", "")))
            if m:
                out[str(p["call_id"])] = int(m.group(1))
    return out


def effects(sid: str, replay: list[dict[str, Any]], markers: Counter[int],
            asked: Counter[int]) -> list[Violation]:
    """Invariants 4 and 5, from the script, the tool_call_begin/end events and
    the marker counts on disk.

    ``asked[k]`` is how many times the script (which the harness wrote) asks
    for marker ``k``'s effect: once. Requests are counted per call id and
    attempt: a ``tool_call_begin`` with ``attempt`` 1 is the model's request,
    a later attempt of the same call is the engine dispatching it again. So:
    an effect on disk more often than the script asks, a non-idempotent call
    dispatched a second time, or the model asked for a marker more often than
    the script asks (a repeated request) is a violation; and every call that
    ended ``ok`` left its effect.
    """
    out: list[Violation] = []
    k_of_call = _marker_calls(replay)
    requests: Counter[int] = Counter()
    outcomes: dict[int, list[tuple[str, int]]] = {}
    turn_of: dict[str, str] = {}
    ended: set[str] = set()
    for e in replay:
        p = e["payload"]
        call = str(p.get("call_id"))
        if e["type"] == "turn_aborted":
            # An abort closes the calls it cut off (their outputs say the effect may
            # be partial): for a call with no tool_call_end, that is its report.
            for c, turn in turn_of.items():
                if turn == p.get("turn_id") and c not in ended:
                    outcomes.setdefault(k_of_call[c], []).append(("aborted", e["sequence"]))
                    ended.add(c)
        if e["type"] == "tool_call_end" and call in k_of_call:
            ended.add(call)
        if e["type"] == "tool_call_begin" and call in k_of_call:
            turn_of[call] = str(p.get("turn_id"))
            k, attempt = k_of_call[call], int(p.get("attempt") or 1)
            if attempt == 1:
                requests[k] += 1
            else:
                out.append(Violation("effect_at_most_once", sid, e["sequence"],
                                     f"non-idempotent call {call} (m-{k}) dispatched again "
                                     f"(attempt {attempt})"))
        elif e["type"] == "tool_call_end" and call in k_of_call:
            outcomes.setdefault(k_of_call[call], []).append(
                (str(p.get("outcome")), e["sequence"]))
    for k, n in sorted(requests.items()):
        if n > asked[k]:
            out.append(Violation("effect_at_most_once", sid, None,
                                 f"the model was asked for m-{k} {n} times; the script asks "
                                 f"{asked[k]} time(s) (a repeated request)"))
    for k, n in sorted(markers.items()):
        if n > asked[k]:
            out.append(Violation("effect_at_most_once", sid, None,
                                 f"shell effect m-{k} happened {n} times; the script asks "
                                 f"{asked[k]} time(s) ({requests[k]} request(s) seen)"))
        if n >= 1 and k not in outcomes:
            out.append(Violation("unknown_reported", sid, None,
                                 f"shell effect m-{k} is on disk but no tool_call_end "
                                 "reports its call"))
    for k, ends in sorted(outcomes.items()):
        oks = sum(1 for o, _ in ends if o == "ok")
        for outcome, seq in ends:
            if outcome not in ("ok", *MAY_HAVE_RUN):
                out.append(Violation("unknown_reported", sid, seq,
                                     f"call m-{k} ended with unexpected outcome {outcome!r}"))
        if oks and markers[k] < oks:
            out.append(Violation("effect_at_most_once", sid, ends[-1][1],
                                 f"call m-{k} ended ok {oks} time(s) but its effect is on "
                                 f"disk {markers[k]} time(s)"))
    return out


def repeated_requests(replay: list[dict[str, Any]]) -> int:
    """Markers the model asked for more than once (first attempts only)."""
    seen: Counter[int] = Counter()
    k_of_call = _marker_calls(replay)
    for e in replay:
        p = e["payload"]
        if (e["type"] == "tool_call_begin" and str(p.get("call_id")) in k_of_call
                and int(p.get("attempt") or 1) == 1):
            seen[k_of_call[str(p["call_id"])]] += 1
    return sum(1 for n in seen.values() if n > 1)


@dataclass(frozen=True)
class Kill:
    """A worker fault and the calls its cgroup showed running at that instant."""

    index: int  # in the report's fault list
    kind: str
    at: float  # time.monotonic() of the kill (or SIGSTOP)
    calls: frozenset[tuple[int, int]]  # (session index, marker k)
    extra_s: float = 0.0  # store faults overlapping its window (commits delayed)


def killed_calls(kills: list[Kill], sessions: list[tuple[str, LiveLog]], window_s: float,
                 downs: Sequence[tuple[float, float]] = ()
                 ) -> tuple[dict[str, int], list[Violation]]:
    """Invariant 5's second half: every call running on a worker when it was
    killed (or hung) ends ``unknown`` with a ``worker_lost`` error, within
    ``window_s`` (the liveness window plus a margin) of the kill, as the
    client saw it live. A call that had already ended before the kill, whose
    ``ok`` answer was already on its way, or that an interrupt aborted, is not
    counted. ``downs`` are the intervals the supervisor or the broker was down
    (from its kill to a while after the farm had it running again): a call
    dispatched before such an interval, or with one starting before its loss
    bound ends, belongs to a process that could not report the loss, so a
    restart's ``unknown`` (never ``failed``) and lateness are accepted for it
    (``excused``). Store faults overlapping the bound extend it (``extra_s``).
    Returns counts and violations."""
    counts = {"checked": 0, "ended_before": 0, "ok_in_flight": 0, "excused": 0, "aborted": 0}
    out: list[Violation] = []
    index = [marker_ends(live) for _, live in sessions]
    begun = [marker_begins(live) for _, live in sessions]
    for kill in kills:
        for i, k in sorted(kill.calls):
            if i >= len(sessions):
                continue
            sid = sessions[i][0]
            ends = index[i].get(k, [])
            after = [(t, e) for t, e in ends if t >= kill.at]
            if ends and not after:
                counts["ended_before"] += 1
                continue
            counts["checked"] += 1
            if not after:
                out.append(Violation("unknown_reported", sid, None,
                                     f"call m-{k} was running on the worker hit by fault "
                                     f"#{kill.index} ({kill.kind}) and never ended"))
                continue
            t, e = after[0]
            p = e["payload"]
            outcome, err = p.get("outcome"), (p.get("error") or {}).get("kind")
            if outcome == "ok":
                counts["ok_in_flight"] += 1
                continue
            if e["type"] == "turn_aborted":  # cancelled by an interrupt: not a loss
                counts["aborted"] += 1
                continue
            bound = window_s + kill.extra_s
            since = max((b for b in begun[i].get(k, []) if b <= kill.at), default=kill.at)
            excused = any(lo <= kill.at + bound and hi >= since for lo, hi in downs)
            if excused:
                counts["excused"] += 1
            if outcome != "unknown" or (err != "worker_lost" and not excused):
                out.append(Violation("unknown_reported", sid, e["sequence"],
                                     f"call m-{k} was running on the worker hit by fault "
                                     f"#{kill.index} ({kill.kind}) and ended {outcome!r} "
                                     f"({err}), not 'unknown' with worker_lost"))
            elif t - kill.at > bound and not excused:
                out.append(Violation("unknown_reported", sid, e["sequence"],
                                     f"call m-{k} on the worker hit by fault #{kill.index} "
                                     f"({kill.kind}) was reported lost {t - kill.at:.2f}s "
                                     f"after the kill (bound {bound:.2f}s)"))
    return counts, out


def ran_out_before_expiry(live: LiveLog, at: float, expiry_s: float, budget_s: float,
                          until: float) -> int:
    """For a worker frozen at ``at`` (``recovery_accounted``): how many requests of
    this session ended on their own deadline (error ``timeout``, seen by ``until``)
    although their budget ran out before the broker could have declared the frozen
    worker lost (``at + expiry_s``, the liveness window). The broker fails such a
    request ``timeout`` when its budget ends, rightly: at the expiry the worker
    holds nothing open, so there is no loss to report. A request's deadline is
    at most its start as the client saw it (``model_step_started`` /
    ``tool_call_begin``, sent before the request) plus ``budget_s``; a request
    whose deadline may lie after the expiry is not counted (it must be reported
    lost, the bug ``lost_call_as_timeout`` plants)."""
    starts: dict[tuple[str, str], float] = {}
    n = 0
    for t, e in live:
        if e.get("sequence", 0) <= 0:
            continue
        p, kind = e.get("payload") or {}, e.get("type")
        if kind == "model_step_started":
            starts[("model", f"{p.get('turn_id')}/{p.get('step')}")] = t
        elif kind == "tool_call_begin":
            starts[("tool", str(p.get("call_id")))] = t
        if t < at or t > until:
            continue
        if kind == "model_step_completed":
            err = ((p.get("diagnostics") or {}).get("error") or {}).get("kind")
            key = ("model", f"{p.get('turn_id')}/{p.get('step')}")
        elif kind == "tool_call_end":
            err = (p.get("error") or {}).get("kind")
            key = ("tool", str(p.get("call_id")))
        else:
            continue
        start = starts.get(key)
        if err == "timeout" and start is not None and start + budget_s <= at + expiry_s:
            n += 1
    return n


def marker_begins(live: LiveLog) -> dict[int, list[float]]:
    """Per marker k, the receive times of its calls' ``tool_call_begin`` events."""
    out: dict[int, list[float]] = {}
    for t, e in live:
        p = e.get("payload") or {}
        if e.get("type") == "tool_call_begin" and e.get("sequence", 0) > 0 \
                and p.get("name") == "shell":
            m = MARKER_ARG_RE.search(json.dumps(p.get("arguments", "")))
            if m:
                out.setdefault(int(m.group(1)), []).append(t)
    return out


def marker_ends(live: LiveLog) -> dict[int, list[tuple[float, dict[str, Any]]]]:
    """Per marker k, what ended its calls, as the client saw it live (with receive
    times): their ``tool_call_end`` events, or the ``turn_aborted`` of their turn
    (an abort closes the calls it cuts off). One pass over the log."""
    k_of_call: dict[str, int] = {}
    open_in_turn: dict[str, set[int]] = {}
    out: dict[int, list[tuple[float, dict[str, Any]]]] = {}
    for t, e in live:
        if e.get("sequence", 0) <= 0:
            continue
        p, kind = e.get("payload") or {}, e.get("type")
        if kind == "tool_call_begin" and p.get("name") == "shell":
            m = MARKER_ARG_RE.search(json.dumps(p.get("arguments", "")))
            if m:
                k_of_call[str(p.get("call_id"))] = int(m.group(1))
                open_in_turn.setdefault(str(p.get("turn_id")), set()).add(int(m.group(1)))
        elif kind == "tool_call_end" and str(p.get("call_id")) in k_of_call:
            out.setdefault(k_of_call[str(p.get("call_id"))], []).append((t, e))
        elif kind == "turn_aborted":
            for k in open_in_turn.pop(str(p.get("turn_id")), set()):
                out.setdefault(k, []).append((t, e))
    return out


def orphans_after_kill(kills: list[tuple[int, str, float, frozenset[tuple[int, int]]]],
                       seen: dict[tuple[str, int, int], tuple[int, float]],
                       sessions: list[tuple[str, LiveLog]], bound_s: float,
                       frozen: dict[tuple[int, int], list[tuple[float, float]]] | None = None,
                       ) -> list[Violation]:
    """Invariant 8 at the kill: when a call is cancelled (``interrupt_tool``) or its
    worker is SIGKILLed, every process of the call (its TERM-ignoring child, its
    double-forked loop) is gone within ``bound_s`` (the sandbox's TERM grace plus
    a margin), although the call would have run on for seconds. ``kills`` lists
    (fault index, kind, instant, calls as (session index, k)). ``frozen`` maps a
    call to the (start, seconds) of each ``worker_hang`` that froze the worker
    running it: a freeze that starts within the bound stops the worker's TERM-to-
    KILL escalation, so the bound grows by its length."""
    out: list[Violation] = []
    for index, kind, at, calls in kills:
        for i, k in sorted(calls):
            bound = bound_s
            for start, seconds in sorted((frozen or {}).get((i, k), [])):
                if at <= start <= at + bound:
                    bound += seconds
            for what in ("long", "orphan"):
                sighting = seen.get((what, i, k))
                if sighting is None or sighting[1] - at <= bound:
                    continue
                sid = sessions[i][0] if i < len(sessions) else ""
                out.append(Violation("no_orphans", sid, None,
                                     f"process chaos-{what} of call m-{k} (pid {sighting[0]}) "
                                     f"was alive {sighting[1] - at:.1f}s after fault #{index} "
                                     f"({kind}) killed its call (bound {bound:.1f}s)"))
    return out


def orphans_seen(seen: dict[tuple[str, int, int], tuple[int, float]],
                 sessions: list[tuple[str, LiveLog]], grace_s: float) -> list[Violation]:
    """Invariant 8 while the farm runs: a long call's processes (its TERM-ignoring
    child and its double-forked loop) are gone within ``grace_s`` of the call's
    last ``tool_call_end``, whatever ended it (a worker kill, an interrupt, a
    restart, a timeout). ``seen`` maps (long|orphan, session, k) to (pid, last
    sighting time)."""
    out: list[Violation] = []
    index = [marker_ends(live) for _, live in sessions]
    for (what, i, k), (pid, last) in sorted(seen.items()):
        if i >= len(sessions):
            continue
        sid = sessions[i][0]
        ends = index[i].get(k, [])
        if not ends:
            continue  # still running when the run ended: the check at farm-down judges it
        ended = ends[-1][0]
        if last - ended > grace_s:
            out.append(Violation("no_orphans", sid, ends[-1][1]["sequence"],
                                 f"process chaos-{what} of call m-{k} (pid {pid}) was alive "
                                 f"{last - ended:.1f}s after the call ended (bound "
                                 f"{grace_s:.1f}s)"))
    return out


def replay_equals_live(sid: str, live: list[dict[str, Any]],
                       replay: list[dict[str, Any]]) -> list[Violation]:
    out: list[Violation] = []
    seqs = [e["sequence"] for e in replay]
    if seqs != list(range(1, len(seqs) + 1)):
        gap = next((i + 1 for i, s in enumerate(seqs) if s != i + 1), None)
        out.append(Violation("replay_equals_live", sid, gap,
                             "the store's event sequences are not dense from 1"))
        return out
    durable_live = [e for e in live if e.get("sequence", 0) > 0]
    live_seqs = [e["sequence"] for e in durable_live]
    if live_seqs != list(range(1, len(live_seqs) + 1)):
        first_bad = next((i + 1 for i, s in enumerate(live_seqs) if s != i + 1), None)
        out.append(Violation("replay_equals_live", sid, first_bad,
                             "clients saw a gap or a duplicate in the live sequences"))
        return out
    for e in durable_live:
        stored = replay[e["sequence"] - 1] if e["sequence"] <= len(replay) else None
        if stored is None:
            out.append(Violation("replay_equals_live", sid, e["sequence"],
                                 "clients saw an event the store does not have"))
            break
        if (stored["type"], stored["payload"], stored.get("submission_id"),
                stored.get("created_at", e.get("created_at"))) != (
                e["type"], e["payload"], e.get("submission_id"), e.get("created_at")):
            same = stored["type"] == e["type"] and stored["payload"] == e["payload"]
            out.append(Violation("replay_equals_live", sid, e["sequence"],
                                 f"live {e['type']} differs from the stored {stored['type']}"
                                 + (" (same content, made at another instant: the event "
                                    "seen live was never stored)" if same else "")))
            break
    return out


def approvals_kept(sid: str, replay: list[dict[str, Any]],
                   answers: dict[str, dict[str, Any]]) -> list[Violation]:
    """Invariant 11 from the stored events and what the harness answered
    (``answers``: approval id -> {"decision": approved | denied, ...})."""
    out: list[Violation] = []
    requested: Counter[str] = Counter()
    asked_in: dict[str, str] = {}  # call id -> approval id
    begun: set[str] = set()
    ends: dict[str, tuple[str, int]] = {}  # call id -> (tool output, sequence)
    for e in replay:
        p = e["payload"]
        if e["type"] == "exec_approval_request":
            approval_id = str(p.get("id"))
            requested[approval_id] += 1
            if requested[approval_id] == 2:
                out.append(Violation("approvals_kept", sid, e["sequence"],
                                     f"approval {approval_id} was requested again"))
            for c in p.get("calls", []):
                call = str(c.get("call_id"))
                if asked_in.setdefault(call, approval_id) != approval_id:
                    out.append(Violation("approvals_kept", sid, e["sequence"],
                                         f"call {call} was asked for approval again "
                                         f"({approval_id} after {asked_in[call]})"))
        elif e["type"] == "tool_call_begin":
            begun.add(str(p.get("call_id")))
        elif e["type"] == "tool_call_end":
            ends.setdefault(str(p.get("call_id")), (str(p.get("output", "")), e["sequence"]))
    for call, approval_id in sorted(asked_in.items()):
        answer = answers.get(approval_id)
        if answer is None:
            continue  # never answered (the turn ended first): nothing was decided
        decision = answer.get("decision")
        output, seq = ends.get(call, ("", None))
        if decision == "denied" and call in begun:
            out.append(Violation("approvals_kept", sid, seq,
                                 f"call {call} was dispatched though its approval "
                                 f"{approval_id} was denied"))
        elif decision == "approved" and "not answered within" in output:
            out.append(Violation("approvals_kept", sid, seq,
                                 f"approval {approval_id} was answered (approved) but its "
                                 f"call {call} was denied as unanswered: the answer was lost"))
        elif decision == "approved" and "denied by the user" in output:
            out.append(Violation("approvals_kept", sid, seq,
                                 f"call {call} was denied though its approval {approval_id} "
                                 "was approved"))
    return out


def compaction_once(sid: str, replay: list[dict[str, Any]],
                    compaction_count: int | None) -> list[Violation]:
    """Invariant 12 from the stored events and the stored checkpoint state."""
    out: list[Violation] = []
    epochs = [(e["payload"].get("epoch"), e["sequence"]) for e in replay
              if e["type"] == "context_compacted"]
    for (a, _), (b, seq) in itertools.pairwise(epochs):
        if not isinstance(a, int) or not isinstance(b, int) or b <= a:
            out.append(Violation("compaction_once", sid, seq,
                                 f"context_compacted epoch {b} after epoch {a}: a compaction "
                                 "settled twice"))
            break
    if compaction_count is not None and compaction_count != len(epochs):
        out.append(Violation("compaction_once", sid, epochs[-1][1] if epochs else None,
                             f"the store counts {compaction_count} compaction(s) but "
                             f"{len(epochs)} context_compacted event(s) were stored"))
    return out


def exports_verify(results: dict[str, dict[str, Any]]) -> list[Violation]:
    """Invariant 7 from ``exportcheck.check_dir``'s results: every export verifies,
    and a copy with any one section tampered with does not."""
    out = []
    for name, r in sorted(results.items()):
        if r.get("problems"):
            out.append(Violation("exports_verify", "", None, f"{name}: {r['problems'][0]}"))
        for section in r.get("tamper_undetected", []):
            out.append(Violation("exports_verify", "", None,
                                 f"{name}: a copy with its {section} tampered with still "
                                 "verifies (the digest does not cover it)"))
        for section, why in sorted((r.get("tamper_skipped") or {}).items()):
            out.append(Violation("exports_verify", "", None,
                                 f"{name}: section {section} could not be tampered with "
                                 f"({why}): the export lacks it"))
    return out


def no_orphans(pids: set[int] | dict[int, float | None], cgroup_root: str = "/sys/fs/cgroup",
               grace_s: float = 2.0) -> list[Violation]:
    """No process the farm ran outlived it, and no tool process of its
    workers did: what is left in each worker's cgroups (``worker_cgroup_dirs``;
    precise, unlike a scan by uid: other farms on the host share the uid range).

    Only the cgroups of workers that are gone are read (a live pid is reported
    itself, and may be another farm's worker reusing the number), and a
    process still listed gets ``grace_s`` to finish dying (SIGKILL and
    die-with-parent are not instantaneous)."""
    started = pids if isinstance(pids, dict) else dict.fromkeys(pids)
    out = []
    for pid in sorted(started):
        try:
            p = psutil.Process(pid)
            # A pid with another start time is a reused number, not the farm's process
            # (over thousands of restarts on a busy host, reuse happens).
            reused = started[pid] is not None and abs(p.create_time() - started[pid]) > 0.01
            if p.status() != psutil.STATUS_ZOMBIE and not reused:
                out.append(Violation("no_orphans", "", None,
                                     f"pid {pid} ({' '.join(p.cmdline()[:4])}) outlived the farm"))
                continue
        except psutil.Error:
            pass
        for d in worker_cgroup_dirs(pid, cgroup_root):
            for orphan in _still_in(f"{d}/cgroup.procs", grace_s):
                out.append(Violation("no_orphans", "", None,
                                     f"tool process {orphan} of worker {pid} (cgroup {d}) "
                                     "outlived the farm"))
    return out


def _still_in(procs_file: str, grace_s: float) -> list[int]:
    """The pids listed in ``procs_file`` once ``grace_s`` has passed, or at once
    when it is empty or gone."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            with open(procs_file) as f:
                left = [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            return []
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)  # bounded by grace_s; only when something is still listed


def fencing(sid: str, rows: Sequence[tuple[int, str | None, int | None]],
            lease: tuple[str | None, int] | None) -> tuple[list[Violation], list[str]]:
    """Invariant 13 from the disk: ``rows`` are the session's events as (sequence,
    lease owner, lease epoch) in sequence order, ``lease`` its lease row at the end
    (owner, epoch). Returns the violations and the owners in turn (each change of
    owner on disk starts a new entry: the evidence that turns crossed owners).

    Epochs only grow (a new one at every acquisition) and a write commits only
    while its epoch is the lease's, so by sequence the epochs never go back and
    an epoch belongs to one owner; an epoch above the lease's, or an event
    without a lease after a leased one, was not written under the lease."""
    out: list[Violation] = []
    turns: list[str] = []
    best: tuple[int, str | None, int] | None = None  # (epoch, owner, sequence) highest so far
    owner_of: dict[int, str | None] = {}
    for seq, owner, epoch in rows:
        if epoch is None:
            if best is not None:
                out.append(Violation("fencing", sid, seq,
                                     f"event {seq} carries no lease after event {best[2]} "
                                     f"was written under epoch {best[0]}"))
                break
            continue
        if not turns or turns[-1] != owner:
            turns.append(str(owner))
        first = owner_of.setdefault(epoch, owner)
        if first != owner:
            out.append(Violation("fencing", sid, seq,
                                 f"epoch {epoch} was written by two owners ({first} and "
                                 f"{owner}): the fencing token did not change with the owner"))
            break
        if best is not None and epoch < best[0]:
            out.append(Violation("fencing", sid, seq,
                                 f"event {seq} was written by {owner} under epoch {epoch} "
                                 f"after event {best[2]} under epoch {best[0]} ({best[1]}): a "
                                 "write under a lost lease"))
            break
        if best is None or epoch > best[0]:
            best = (epoch, owner, seq)
    if best is not None and lease is not None and best[0] > lease[1]:
        out.append(Violation("fencing", sid, best[2],
                             f"event {best[2]} carries epoch {best[0]}, above the lease's "
                             f"epoch {lease[1]}"))
    return out, turns


def usage_accounted(sid: str, replay: list[dict[str, Any]], total_usage: dict[str, Any] | None,
                    scripted: dict[str, list[dict[str, int]]] | None) -> list[Violation]:
    """Invariant 14 from the stored events, the stored checkpoint state and the
    script the harness wrote. Each model step's ``token_count`` counts the usage
    of the one answer that step took (the script says it: ``scripted`` maps an
    answer's text to the usages the script gives it, several when one text is
    answered with different usage, as the demo's script does, and then any one of
    them will do; an attempt that failed or was cut counts nothing),
    each ``token_count``'s ``total`` is the sum of every ``last`` so far, and the
    store's ``total_usage`` is that sum at the end: a retried call counted twice,
    a step counted again after a restart, or a total that drifts from its parts
    is a violation."""
    out: list[Violation] = []
    running: Counter[str] = Counter()
    prev: str | None = None
    said: str | None = None  # the text of the model step being committed
    step_text: str | None = None
    for e in replay:
        p, kind = e["payload"], e["type"]
        if kind == "agent_message":
            said = str(p.get("text", ""))
        elif kind == "model_step_completed":
            step_text, said = said, None
        elif kind == "token_count":
            last = {k: int(v) for k, v in (p.get("last") or {}).items()}
            running.update(last)
            total = p.get("total")
            if isinstance(total, dict) and any(int(total.get(k, 0)) != running[k]
                                               for k in running):
                out.append(Violation("usage_accounted", sid, e["sequence"],
                                     f"token_count total {total} is not the sum of the "
                                     f"usage counted so far {dict(running)}"))
                return out
            wants = (scripted or {}).get(step_text or "") if prev == "model_step_completed" \
                else None
            if wants and not any(all(last.get(k) == v for k, v in want.items())
                                 for want in wants):
                shown = wants[0] if len(wants) == 1 else f"one of {wants}"
                out.append(Violation("usage_accounted", sid, e["sequence"],
                                     f"the model step that answered {step_text!r} counted "
                                     f"usage {last}; the provider reported {shown} once"))
                return out
        prev = kind
    if total_usage is not None and any(int(total_usage.get(k, 0)) != running[k]
                                       for k in set(running) | set(total_usage)):
        out.append(Violation("usage_accounted", sid, None,
                             f"the store's total_usage {dict(total_usage)} is not the sum of "
                             f"the token_count events {dict(running)}"))
    return out


def scripted_usage(script: dict[str, Any]) -> dict[str, list[dict[str, int]]]:
    """An answer's text -> every usage the scripted provider reports with it."""
    out: dict[str, list[dict[str, int]]] = {}
    for r in script.get("responses", []):
        if r.get("text") and r.get("usage"):
            usage = {k: int(v) for k, v in r["usage"].items()}
            seen = out.setdefault(str(r["text"]), [])
            if usage not in seen:
                seen.append(usage)
    return out


def transcript_complete(sid: str, replay: list[dict[str, Any]],
                        context: list[dict[str, Any]]) -> list[Violation]:
    """Invariant 15 from the stored events and the stored context: what a turn
    reported is in the transcript the next model call is sent. A ``turn_complete``
    with no compaction after it has its final answer (``last_agent_message``) as
    an assistant message of the context; every ``user_message`` after the last
    compaction, and the newest one before it (a compaction keeps the recent user
    messages verbatim, ``compaction_keep_recent``), is a user message of the
    context."""
    out: list[Violation] = []
    said = {message_text(i) for i in context
            if i.get("type") == "message" and i.get("role") == "assistant"}
    asked = {message_text(i) for i in context
             if i.get("type") == "message" and i.get("role") == "user"}
    last_compacted = max((e["sequence"] for e in replay if e["type"] == "context_compacted"),
                         default=0)
    newest_before: dict[str, Any] | None = None
    for e in replay:
        p = e["payload"]
        if e["type"] == "user_message" and e["sequence"] < last_compacted:
            newest_before = e
        if e["sequence"] < last_compacted:
            continue
        if e["type"] == "turn_complete" and p.get("last_agent_message") \
                and str(p["last_agent_message"]) not in said:
            out.append(Violation("transcript_complete", sid, e["sequence"],
                                 f"turn {p.get('turn_id')} completed with the answer "
                                 f"{p['last_agent_message']!r}, which the stored context "
                                 "lacks"))
        if e["type"] == "user_message" and str(p.get("text", "")) not in asked:
            out.append(Violation("transcript_complete", sid, e["sequence"],
                                 f"user message {p.get('text')!r} is missing from the "
                                 "stored context"))
    if newest_before is not None and str(newest_before["payload"].get("text", "")) not in asked:
        out.append(Violation("transcript_complete", sid, newest_before["sequence"],
                             f"user message {newest_before['payload'].get('text')!r}, the "
                             f"newest before the compaction at {last_compacted}, is missing "
                             "from the stored context (a compaction lost it)"))
    return out


def export_matches_store(name: str, doc: Any,
                         stored: list[dict[str, Any]] | None) -> list[Violation]:
    """Invariant 16 for one export: its transcript (``logical_resume.messages``) is
    the store's context at the position it names (``position``: the epoch and the
    batch it stands after), read from the store after the farm stopped. A digest
    covers what the export holds, not what it should hold: an export missing its
    last batch verifies, and only the store shows the batch it lacks."""
    try:
        resume = doc["content"]["logical_resume"]
        sid, messages = str(resume["session_id"]), list(resume["messages"])
    except (KeyError, TypeError):
        return []  # a malformed export is exports_verify's to report
    if stored is None:
        return [Violation("export_matches_store", sid, None,
                          f"{name}: the store has no context at {resume.get('position')}")]
    if messages == stored:
        return []
    n = next((i for i, (a, b) in enumerate(zip(messages, stored, strict=False)) if a != b),
             min(len(messages), len(stored)))
    return [Violation("export_matches_store", sid, None,
                      f"{name}: its transcript ({len(messages)} items) is not the store's "
                      f"context at {resume.get('position')} ({len(stored)} items); they "
                      f"differ from item {n}")]


def outputs_match_calls(sid: str, replay: list[dict[str, Any]]) -> list[Violation]:
    """Invariant 17 with the scripted workload, from the stored events: an ``ok``
    call's output is its own call's. The workload's outputs tell their call: a
    ``write_file`` names the path it wrote, a long ``shell`` call prints ``running
    m-K`` for its own marker, and no other call prints either. An output handed to
    another call of the round (results matched by position, not by call id) shows."""
    out: list[Violation] = []
    begun: dict[str, tuple[str, dict[str, Any]]] = {}
    for e in replay:
        p = e["payload"]
        call = str(p.get("call_id"))
        if e["type"] == "tool_call_begin":
            args = p.get("arguments")
            begun[call] = (str(p.get("name")), args if isinstance(args, dict) else {})
            continue
        if e["type"] != "tool_call_end" or p.get("outcome") != "ok" or call not in begun:
            continue
        name, args = begun[call]
        output = str(p.get("output", ""))
        running = re.search(r"echo running (m-\d+)", str(args.get("command", "")))
        if name == "write_file":
            want: str | None = f"to {args.get('path')}"
        elif name == "shell" and running:
            want = f"running {running.group(1)}"
        else:
            want = None
        wrong = (want is not None and want not in output) or (
            want is None and ("running m-" in output or "wrote " in output))
        if wrong:
            out.append(Violation("outputs_match_calls", sid, e["sequence"],
                                 f"{name} call {call} ended ok with an output that is not "
                                 f"its own: {output[:80]!r}"))
    return out
