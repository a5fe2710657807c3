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
   often than the model requested it (markers counted on disk, requests are
   ``tool_call_begin`` events); every ``ok`` call's effect is on disk.
5. ``unknown_reported``: an effect on disk whose call did not end ``ok`` was
   reported as ``unknown`` (or as a failure that may have run), never as
   "not run"; an effect with no ``tool_call_end`` at all is a violation.
6. ``replay_equals_live``: the durable events replayed from the store equal
   what clients saw live, with no gap or duplicate in the sequences.
7. ``exports_verify``: every exported checkpoint verifies.
8. ``no_orphans``: no process outlives the farm's shutdown.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from sandbox_worker.api import worker_cgroup_dirs

ALL_CHECKS = ("turn_ends_once", "not_wedged", "one_output_per_call", "effect_at_most_once",
              "unknown_reported", "replay_equals_live", "exports_verify", "no_orphans")
# These count the scripted workload's markers on disk; a real model improvises.
MARKER_CHECKS = ("effect_at_most_once", "unknown_reported")
MARKER_ARG_RE = re.compile(r"echo m-(\d+) >> effects\.log")
MAY_HAVE_RUN = {"unknown", "timeout", "cancelled", "error", "failed"}


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


def effects(sid: str, replay: list[dict[str, Any]], markers: Counter[int]) -> list[Violation]:
    """Invariants 4 and 5, from tool_call_begin/end events and the marker counts.

    The unit is a *request*: one ``tool_call_begin`` (the engine never re-runs
    a non-idempotent call itself, so each begin is one request from the model).
    If the model asks for the same marker twice (a resumed turn can ask the
    scripted model again), two effects are right, so effects are compared with
    the requests: never more effects than requests, and every request that
    ended ``ok`` left its effect.
    """
    out: list[Violation] = []
    requests: Counter[int] = Counter()
    k_of_call: dict[str, int] = {}
    outcomes: dict[int, list[tuple[str, int]]] = {}
    for e in replay:
        p = e["payload"]
        if e["type"] == "tool_call_begin" and p.get("name") == "shell":
            m = MARKER_ARG_RE.search(json.dumps(p.get("arguments", "")))
            if m:
                k_of_call[p["call_id"]] = int(m.group(1))
                requests[int(m.group(1))] += 1
        elif e["type"] == "tool_call_end" and p.get("call_id") in k_of_call:
            k = k_of_call[p["call_id"]]
            outcomes.setdefault(k, []).append((str(p.get("outcome")), e["sequence"]))
    for k, n in sorted(markers.items()):
        if n > max(requests[k], 1):
            out.append(Violation("effect_at_most_once", sid, None,
                                 f"shell effect m-{k} happened {n} times for "
                                 f"{requests[k]} request(s)"))
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
        if oks > requests[k]:
            out.append(Violation("effect_at_most_once", sid, ends[-1][1],
                                 f"call m-{k} ended ok {oks} times for {requests[k]} "
                                 "request(s)"))
        if oks and markers[k] < oks:
            out.append(Violation("effect_at_most_once", sid, ends[-1][1],
                                 f"call m-{k} ended ok {oks} time(s) but its effect is on "
                                 f"disk {markers[k]} time(s)"))
    return out


def repeated_requests(replay: list[dict[str, Any]]) -> int:
    """Markers the model asked for more than once (reported, not a violation)."""
    seen: Counter[int] = Counter()
    for e in replay:
        p = e["payload"]
        if e["type"] == "tool_call_begin" and p.get("name") == "shell":
            m = MARKER_ARG_RE.search(json.dumps(p.get("arguments", "")))
            if m:
                seen[int(m.group(1))] += 1
    return sum(1 for n in seen.values() if n > 1)


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
        if (stored["type"], stored["payload"], stored.get("submission_id")) != (
                e["type"], e["payload"], e.get("submission_id")):
            out.append(Violation("replay_equals_live", sid, e["sequence"],
                                 f"live {e['type']} differs from the stored {stored['type']}"))
            break
    return out


def exports_verify(export_dir: Path) -> tuple[int, list[Violation]]:
    from supervisor.export import verify

    files = sorted(export_dir.glob("*.json")) if export_dir.is_dir() else []
    out = []
    for f in files:
        try:
            problems = verify(json.loads(f.read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            problems = [str(exc)]
        if problems:
            out.append(Violation("exports_verify", "", None, f"{f.name}: {problems[0]}"))
    return len(files), out


def no_orphans(pids: set[int], cgroup_root: str = "/sys/fs/cgroup",
               grace_s: float = 2.0) -> list[Violation]:
    """No process the farm ran outlived it, and no tool process of its
    workers did: what is left in each worker's cgroups (``worker_cgroup_dirs``;
    precise, unlike a scan by uid: other farms on the host share the uid range).

    Only the cgroups of workers that are gone are read (a live pid is reported
    itself, and may be another farm's worker reusing the number), and a
    process still listed gets ``grace_s`` to finish dying (SIGKILL and
    die-with-parent are not instantaneous)."""
    out = []
    for pid in sorted(pids):
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
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
