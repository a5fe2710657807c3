"""The checker's own tests: evidence in, violations out.

Each test builds the evidence a run leaves (a replay, a live log with
receive times, a workspace on disk, process-table sightings, an export file)
and checks the invariant reports exactly the violation it must, naming it.
Several of these pass on the old checker's bugs only by failing: an effect
re-run by a second dispatch attempt, the model asked twice, a lost call
reported as ``failed``/``timeout``, a late loss report, a digest that does
not cover the run records.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

from supervisor.chaos import invariants as inv
from supervisor.chaos.exportcheck import check_doc
from supervisor.chaos.invariants import (
    Kill,
    approvals_kept,
    compaction_once,
    effects,
    exports_verify,
    killed_calls,
    no_orphans,
    orphans_after_kill,
    orphans_seen,
    ran_out_before_expiry,
    repeated_requests,
    silent_timeouts,
)
from supervisor.chaos.workload import count_markers, make_script, requests_in
from supervisor.export.canonical import canonical_bytes, digest_bytes
from tests.helpers import PYTHON, REPO

GOLDEN = Path(__file__).parent / "data" / "export_compacted_mid_turn.json"
ONCE = Counter({k: 1 for k in range(100)})  # the script asks for every marker once


def begin(seq: int, k: int, call: str, attempt: int = 1, turn: str = "t1") -> dict[str, Any]:
    return {"sequence": seq, "type": "tool_call_begin", "payload": {
        "name": "shell", "call_id": call, "turn_id": turn, "attempt": attempt,
        "arguments": {"command": f"echo m-{k} >> effects.log && sleep 0.05"}}}


def end(seq: int, call: str, outcome: str, error: str | None = None) -> dict[str, Any]:
    payload: dict[str, Any] = {"call_id": call, "outcome": outcome}
    if error:
        payload["error"] = {"kind": error, "message": "x", "retryable": True}
    return {"sequence": seq, "type": "tool_call_end", "payload": payload}


def aborted(seq: int, turn: str = "t1") -> dict[str, Any]:
    return {"sequence": seq, "type": "turn_aborted",
            "payload": {"turn_id": turn, "reason": "interrupted"}}


# -- effect_at_most_once / unknown_reported from the script and the disk ---------


def test_one_request_one_effect_is_clean() -> None:
    assert effects("s", [begin(1, 7, "c"), end(2, "c", "ok")], Counter({7: 1}), ONCE) == []


def test_a_second_dispatch_attempt_of_a_shell_call_is_a_violation() -> None:
    # The rerun_after_restart bug: one request, dispatched again after a restart.
    # The old checker counted each begin as a request and saw 2 effects, 2 requests.
    replay = [begin(1, 7, "c"), begin(2, 7, "c", attempt=2), end(3, "c", "ok")]
    found = effects("s", replay, Counter({7: 2}), ONCE)
    assert {v.invariant for v in found} == {"effect_at_most_once"}
    assert any("dispatched again (attempt 2)" in v.detail for v in found)
    assert any("happened 2 times; the script asks 1" in v.detail for v in found)


def test_the_model_asked_twice_when_the_script_asks_once_is_a_violation() -> None:
    replay = [begin(1, 7, "c"), end(2, "c", "ok"), begin(3, 7, "c"), end(4, "c", "ok")]
    found = effects("s", replay, Counter({7: 2}), ONCE)
    assert {v.invariant for v in found} == {"effect_at_most_once"}
    assert any("a repeated request" in v.detail for v in found)
    assert repeated_requests(replay) == 1


def test_an_effect_with_no_reported_end_and_an_ok_without_effect() -> None:
    lost = effects("s", [begin(1, 7, "c")], Counter({7: 1}), ONCE)
    assert [v.invariant for v in lost] == ["unknown_reported"]
    missing = effects("s", [begin(1, 8, "d"), end(2, "d", "ok")], Counter(), ONCE)
    assert [v.invariant for v in missing] == ["effect_at_most_once"]
    unknown = effects("s", [begin(1, 9, "e"), end(2, "e", "unknown")], Counter({9: 1}), ONCE)
    assert unknown == []


def test_an_abort_reports_the_calls_it_cut_off() -> None:
    replay = [begin(1, 7, "c", turn="t1"), aborted(2, "t1")]
    assert effects("s", replay, Counter({7: 1}), ONCE) == []
    other_turn = [begin(1, 7, "c", turn="t1"), aborted(2, "t2")]
    assert [v.invariant for v in effects("s", other_turn, Counter({7: 1}), ONCE)] == [
        "unknown_reported"]


def test_count_markers_reads_the_workspace(tmp_path: Path) -> None:
    assert count_markers(tmp_path) == Counter()  # no effects.log yet
    (tmp_path / "effects.log").write_text("m-1\nm-2\n m-2 \nnoise m-3\nm-x\n\nm-10\n")
    assert count_markers(tmp_path) == Counter({1: 1, 2: 2, 10: 1})


def test_from_disk_evidence_to_a_reported_violation(tmp_path: Path) -> None:
    # The whole path: the script the harness wrote, the workspace a run left, the
    # replay; a marker twice on disk must come out as a named violation.
    script = make_script(2, 3, 1, ())
    asked = requests_in(script)
    assert asked[0] == 1
    assert asked[3] == 0
    (tmp_path / "effects.log").write_text("m-0\nm-0\nm-1\n")
    replay = [begin(1, 0, "call_0_0"), end(2, "call_0_0", "ok"),
              begin(3, 1, "call_1_0"), end(4, "call_1_0", "ok")]
    found = effects("s", replay, count_markers(tmp_path), asked)
    assert [(v.invariant, v.session_id) for v in found] == [("effect_at_most_once", "s")]
    assert "m-0 happened 2 times" in found[0].detail


# -- unknown_reported: calls on a killed worker ----------------------------------


def live_of(*items: tuple[float, dict[str, Any]]) -> list[tuple[float, dict[str, Any]]]:
    return list(items)


def killed(extra: float = 0.0) -> list[Kill]:
    return [Kill(3, "worker_kill_tool", 10.0, frozenset({(0, 4)}), extra)]


def test_a_call_on_a_killed_worker_must_end_unknown_with_worker_lost_promptly() -> None:
    start = (9.0, begin(1, 4, "c"))
    prompt = live_of(start, (11.2, end(2, "c", "unknown", "worker_lost")))
    counts, found = killed_calls(killed(), [("s", prompt)], 3.0)
    assert found == []
    assert counts["checked"] == 1
    # lost_call_as_timeout: left to time out, reported as failed at the deadline
    timed_out = live_of(start, (19.0, end(2, "c", "failed", "timeout")))
    found = killed_calls(killed(), [("s", timed_out)], 3.0)[1]
    assert [v.invariant for v in found] == ["unknown_reported"]
    assert "ended 'failed' (timeout)" in found[0].detail
    late = live_of(start, (14.5, end(2, "c", "unknown", "worker_lost")))
    found = killed_calls(killed(), [("s", late)], 3.0)[1]
    assert "reported lost 4.50s after the kill" in found[0].detail
    # a store fault in the window extends the bound by its length
    assert killed_calls(killed(extra=2.0), [("s", late)], 3.0)[1] == []
    never = live_of(start)
    assert "never ended" in killed_calls(killed(), [("s", never)], 3.0)[1][0].detail


def test_killed_call_exceptions_come_from_the_evidence() -> None:
    start = (9.0, begin(1, 4, "c"))
    before = live_of(start, (9.9, end(2, "c", "ok")))
    counts, found = killed_calls(killed(), [("s", before)], 3.0)
    assert found == []
    assert counts["ended_before"] == 1
    in_flight = live_of(start, (10.1, end(2, "c", "ok")))
    counts, found = killed_calls(killed(), [("s", in_flight)], 3.0)
    assert found == []
    assert counts["ok_in_flight"] == 1
    cancelled = live_of(start, (10.5, aborted(2)))
    counts, found = killed_calls(killed(), [("s", cancelled)], 3.0)
    assert found == []
    assert counts["aborted"] == 1
    # the supervisor down between the call's dispatch and the end of its loss bound:
    # its restart's own "unknown" is fine, late is fine ...
    restart = live_of(start, (16.0, end(2, "c", "unknown")))
    for down in [(8.0, 9.5), (12.5, 15.0)]:  # before the kill (after dispatch), after it
        assert killed_calls(killed(), [("s", restart)], 3.0, [down])[1] == []
    # ... but not when it was down only before the call was dispatched or after the bound
    for down in [(5.0, 8.9), (13.1, 15.0)]:
        assert killed_calls(killed(), [("s", restart)], 3.0, [down])[1] != []
    # ... and "failed" never is
    failed = live_of(start, (16.0, end(2, "c", "failed", "timeout")))
    assert killed_calls(killed(), [("s", failed)], 3.0, [(8.0, 9.5)])[1] != []


def test_a_tool_call_on_its_deadline_without_frame_drops_is_a_lost_call() -> None:
    replay = [begin(1, 4, "c"), end(2, "c", "failed", "timeout"),
              begin(3, 5, "d"), end(4, "d", "failed", "exit")]
    found = silent_timeouts("s", replay)
    assert [(v.invariant, v.sequence) for v in found] == [("unknown_reported", 2)]
    # a model step attempt on its deadline (its retry hides it from the turn)
    step = {"sequence": 5, "type": "model_step_completed",
            "payload": {"turn_id": "t", "step": 2, "outcome": "retrying",
                        "diagnostics": {"error": {"kind": "timeout"}}}}
    assert len(silent_timeouts("s", [*replay, step])) == 1  # provider_hang on: not judged
    found = silent_timeouts("s", [*replay, step], models=True)
    assert [v.sequence for v in found] == [2, 5]


# -- no_orphans ------------------------------------------------------------------


def test_orphans_after_a_kill_and_after_the_call_ended() -> None:
    live = [("s", live_of((1.0, begin(1, 4, "c")), (5.0, end(2, "c", "unknown", "worker_lost"))))]
    cut = [(2, "interrupt_tool", 4.0, frozenset({(0, 4)}))]
    gone = {("long", 0, 4): (100, 5.5), ("orphan", 0, 4): (101, 6.0)}
    assert orphans_after_kill(cut, gone, live, 4.0) == []
    assert orphans_seen(gone, live, 10.0) == []
    lingering = {("long", 0, 4): (100, 5.5), ("orphan", 0, 4): (101, 30.0)}
    found = orphans_after_kill(cut, lingering, live, 4.0)
    assert [v.invariant for v in found] == ["no_orphans"]
    assert "chaos-orphan of call m-4 (pid 101) was alive 26.0s after fault #2" in found[0].detail
    assert [v.invariant for v in orphans_seen(lingering, live, 10.0)] == ["no_orphans"]


def test_no_orphans_sees_live_farm_pids_and_tool_processes_left_in_worker_cgroups(
        tmp_path: Path) -> None:
    gone = 2**22 + 7  # above pid_max's default: no such process
    left = tmp_path / "pids" / "corral" / f"worker-{gone}"
    left.mkdir(parents=True)
    (left / "cgroup.procs").write_text("4242\n4243\n")
    empty = tmp_path / "memory" / "corral" / f"worker-{gone}"
    empty.mkdir(parents=True)
    (empty / "cgroup.procs").write_text("")
    found = [v.detail for v in no_orphans({gone, os.getpid()}, str(tmp_path), grace_s=0.2)]
    assert len(found) == 3, found
    assert f"pid {os.getpid()}" in found[0]  # this process is alive: it "outlived the farm"
    assert [d.split()[2] for d in found[1:]] == ["4242", "4243"]
    assert all(f"of worker {gone}" in d for d in found[1:])
    assert no_orphans({gone}, str(tmp_path / "nothing")) == []
    # a process that leaves the cgroup within the grace is no orphan
    (left / "cgroup.procs").write_text("")
    assert no_orphans({gone}, str(tmp_path)) == []


def test_no_orphans_tells_a_reused_pid_from_the_farms_process(tmp_path: Path) -> None:
    """Pids are compared with their start time: a live pid that started at another
    time is a reused number (a soak with 700 restarts met one), not an orphan."""
    me = psutil.Process().create_time()
    assert no_orphans({os.getpid(): me}, str(tmp_path), grace_s=0.2) != []
    assert no_orphans({os.getpid(): me - 60.0}, str(tmp_path), grace_s=0.2) == []
    assert no_orphans({os.getpid(): None}, str(tmp_path), grace_s=0.2) != []  # unknown: kept


# -- exports_verify: every section tampered with ---------------------------------


def test_a_good_export_verifies_and_every_tampered_section_is_caught() -> None:
    doc = json.loads(GOLDEN.read_text())
    result = check_doc(doc)
    assert result == {"problems": [], "tamper_undetected": [], "tamper_skipped": {}}
    assert exports_verify({"good.json": result}) == []


def test_a_digest_that_leaves_out_the_run_records_is_a_violation() -> None:
    # What export_digest_partial writes: the digest of the content without the run
    # records. The old checker only verified the file as written -- and a verify
    # computing the same partial digest passes it.
    doc = json.loads(GOLDEN.read_text())
    partial = copy.deepcopy(doc["content"])
    partial["snapshot"]["run_records"] = []
    data = canonical_bytes(partial)
    doc["descriptor"]["digest"], doc["descriptor"]["size"] = digest_bytes(data), len(data)
    assert check_doc(doc)["problems"]  # the real verify rejects it as written ...
    fake = {"problems": [], "tamper_undetected": ["run_records", "snapshot"],
            "tamper_skipped": {}}  # ... a verify with the same bug reports this
    found = exports_verify({"bad.json": fake})
    assert [v.invariant for v in found] == ["exports_verify", "exports_verify"]
    assert "run_records tampered with still verifies" in found[0].detail
    missing = exports_verify({"odd.json": {"problems": [], "tamper_undetected": [],
                                           "tamper_skipped": {"snapshot": "no run"}}})
    assert [v.invariant for v in missing] == ["exports_verify"]


def test_the_planted_partial_digest_is_caught_by_tampering(tmp_path: Path) -> None:
    # End to end in a process with the plant on: an export sealed and verified by
    # the same partial digest verifies as written; only tampering shows the hole.
    probe = (
        "import json, sys\n"
        "from supervisor.chaos.exportcheck import check_doc\n"
        "from supervisor.export.checkpoint import seal\n"
        "doc = json.load(open(sys.argv[1]))\n"
        "print(json.dumps(check_doc(seal(doc['content']))))\n")
    out = subprocess.run([PYTHON, "-c", probe, str(GOLDEN)], cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=True,
                         env={"PATH": "/usr/bin:/bin",
                              "CORRAL_CHAOS_PLANTS": "export_digest_partial"})
    result = json.loads(out.stdout)
    assert result["problems"] == []
    assert result["tamper_undetected"] == ["run_records", "snapshot"]
    assert {v.invariant for v in exports_verify({"x.json": result})} == {"exports_verify"}


def request(seq: int, approval: str, *calls: str) -> dict[str, Any]:
    return {"sequence": seq, "type": "exec_approval_request",
            "payload": {"id": approval, "calls": [{"call_id": c} for c in calls]}}


def denied_end(seq: int, call: str, why: str) -> dict[str, Any]:
    return {"sequence": seq, "type": "tool_call_end",
            "payload": {"call_id": call, "outcome": "deny", "output": f"Tool call not run: {why}"}}


def test_an_approval_is_requested_once_and_its_answer_is_the_one_applied() -> None:
    approved = {"a1": {"decision": "approved"}}
    good = [request(1, "a1", "c1"), begin(2, 1, "c1"), end(3, "c1", "ok")]
    assert approvals_kept("s", good, approved) == []
    denied = [request(1, "a1", "c1"), denied_end(2, "c1", "denied by the user")]
    assert approvals_kept("s", denied, {"a1": {"decision": "denied"}}) == []
    assert approvals_kept("s", denied, {}) == []  # never answered: nothing decided
    # Asked again after a restart (a new request for the same call): answered twice.
    again = [request(1, "a1", "c1"), request(2, "a2", "c1"), begin(3, 1, "c1")]
    v = approvals_kept("s", again, {"a1": {"decision": "approved"},
                                    "a2": {"decision": "approved"}})
    assert [x.invariant for x in v] == ["approvals_kept"]
    assert "asked for approval again" in (
        v[0].detail)
    # The same request event twice.
    twice = [request(1, "a1", "c1"), request(2, "a1", "c1")]
    assert "requested again" in approvals_kept("s", twice, {})[0].detail
    # A denied call dispatched; an approved call left to the approval timeout (the
    # answer lost) or denied.
    ran = [request(1, "a1", "c1"), begin(2, 1, "c1")]
    assert "was denied" in approvals_kept("s", ran, {"a1": {"decision": "denied"}})[0].detail
    lost = [request(1, "a1", "c1"), denied_end(
        2, "c1", "denied: the approval request was not answered within 30s")]
    assert "answer was lost" in approvals_kept("s", lost, approved)[0].detail
    flipped = [request(1, "a1", "c1"), denied_end(2, "c1", "denied by the user")]
    assert approvals_kept("s", flipped, approved)[0].sequence == 2


def test_a_compaction_settles_once() -> None:
    def compacted(seq: int, epoch: int) -> dict[str, Any]:
        return {"sequence": seq, "type": "context_compacted", "payload": {"epoch": epoch}}
    assert compaction_once("s", [compacted(3, 1), compacted(9, 2)], 2) == []
    twice = compaction_once("s", [compacted(3, 1), compacted(4, 1)], 2)
    assert [(x.invariant, x.sequence) for x in twice] == [("compaction_once", 4)]
    counted = compaction_once("s", [compacted(3, 1)], 2)
    assert "counts 2 compaction(s) but 1" in counted[0].detail
    assert compaction_once("s", [], None) == []


def test_a_hang_of_the_worker_doing_the_kill_extends_the_kill_bound() -> None:
    # The soak: an interrupt at t=0, then a worker_hang froze the worker running the
    # call for 2.55 s from t=2.5: its TERM-to-KILL escalation was stopped with it.
    seen = {("long", 0, 7): (123, 4.8), ("orphan", 0, 7): (124, 4.8)}
    kills = [(1, "interrupt_tool", 0.0, frozenset({(0, 7)}))]
    sessions = [("s", [])]
    assert len(orphans_after_kill(kills, seen, sessions, 4.0)) == 2  # type: ignore[arg-type]
    frozen = {(0, 7): [(2.5, 2.55)]}
    assert orphans_after_kill(kills, seen, sessions, 4.0, frozen) == []  # type: ignore[arg-type]
    late = {(0, 7): [(4.5, 2.55)]}  # a freeze after the bound excuses nothing
    assert len(orphans_after_kill(kills, seen, sessions, 4.0, late)) == 2  # type: ignore[arg-type]


def test_a_hang_right_after_an_interrupt_extends_the_kill_bound() -> None:
    # The soak's interrupt #870: the worker running the cancelled call was frozen
    # 0.2 s after the interrupt, for 2.06 s (its log is silent from then; it
    # re-registered 2.06 s later); the processes were last seen 4.0 s after.
    sessions = [("s", [])]
    kills = [(1, "interrupt_tool", 0.0, frozenset({(0, 132)}))]
    frozen = {(0, 132): [(0.2, 2.06)]}
    seen = {("long", 0, 132): (1, 4.05), ("orphan", 0, 132): (2, 4.05)}
    assert len(orphans_after_kill(kills, seen, sessions, 4.0)) == 2  # type: ignore[arg-type]
    assert orphans_after_kill(kills, seen, sessions, 4.0, frozen) == []  # type: ignore[arg-type]
    # the freeze does not excuse a process alive past the extended bound (6.06 s)
    later = {("long", 0, 132): (1, 6.3)}
    bad = orphans_after_kill(kills, later, sessions, 4.0, frozen)  # type: ignore[arg-type]
    assert len(bad) == 1
    assert "bound 6.1s" in bad[0].detail


def _step(seq: int, kind: str, **payload: Any) -> dict[str, Any]:
    return {"sequence": seq, "type": kind, "payload": {"turn_id": "t", **payload}}


def test_requests_that_ran_out_of_budget_before_the_expiry_need_no_loss_report() -> None:
    # The soak's fault #468: a worker frozen at t=18.7 held model requests sent at
    # t=9.1 with a 10 s budget; the broker failed them ``timeout`` at t=19.2, before
    # the liveness window (1 s) could expire the worker.
    def timed_out(start: float, end: float, step: int) -> list[tuple[float, dict[str, Any]]]:
        err = {"error": {"kind": "timeout", "message": "budget ran out at the worker"}}
        return [(start, _step(2 * step, "model_step_started", step=step, attempt=1)),
                (end, _step(2 * step + 1, "model_step_completed", step=step, attempt=1,
                            outcome="retrying", diagnostics=err))]
    live = timed_out(9.1, 19.2, 1)
    assert ran_out_before_expiry(live, 18.7, 1.0, 10.0, 21.7) == 1
    # a request whose deadline lies after the expiry must be reported lost: its
    # timeout is what the plant lost_call_as_timeout leaves, not an excuse
    assert ran_out_before_expiry(timed_out(12.0, 22.0, 1), 18.7, 1.0, 10.0, 25.0) == 0
    # a worker_lost report is no deadline ending; an ending before the freeze neither
    lost = [(9.1, _step(2, "model_step_started", step=1)),
            (19.8, _step(3, "model_step_completed", step=1, diagnostics={
                "error": {"kind": "worker_lost"}}))]
    assert ran_out_before_expiry(lost, 18.7, 1.0, 10.0, 21.7) == 0
    assert ran_out_before_expiry(timed_out(8.0, 18.0, 1), 18.7, 1.0, 10.0, 21.7) == 0
    # tool calls the same way, by call id
    tool = [(9.0, {"sequence": 5, "type": "tool_call_begin", "payload": {"call_id": "c"}}),
            (19.0, {"sequence": 6, "type": "tool_call_end",
                    "payload": {"call_id": "c", "error": {"kind": "timeout"}}})]
    assert ran_out_before_expiry(tool, 18.7, 1.0, 10.0, 21.7) == 1


def test_fencing_reads_each_events_lease_from_the_disk() -> None:
    """Invariant 13 (several supervisors): by sequence, the epochs of a session's events
    never go back, an epoch has one owner, none is above the lease's, and no event
    after a leased one lacks a lease. A change of owner is what it records."""
    # a: epoch 1; b took it over (2); a restarted under its own id and took it back (3)
    clean = [(1, None, None), (2, "a", 1), (3, "a", 1), (4, "b", 2), (5, "a", 3)]
    bad, owners = inv.fencing("s", clean, ("a", 3))
    assert bad == []
    assert owners == ["a", "b", "a"]
    # a paused past its lease wrote after b's takeover: a write under a lost lease
    late = [(1, "a", 1), (2, "b", 2), (3, "a", 1)]
    bad, _ = inv.fencing("s", late, ("b", 2))
    assert [(v.invariant, v.sequence) for v in bad] == [("fencing", 3)]
    assert "under epoch 1 after event 2 under epoch 2 (b)" in bad[0].detail
    # the token did not change with the owner (the plant epoch_reused)
    reused = [(1, "a", 1), (2, "b", 1)]
    bad, _ = inv.fencing("s", reused, ("b", 1))
    assert [v.sequence for v in bad] == [2]
    assert "two owners" in bad[0].detail
    bad, _ = inv.fencing("s", [(1, "a", 1), (2, None, None)], ("a", 1))
    assert [v.sequence for v in bad] == [2]
    assert "no lease" in bad[0].detail
    bad, _ = inv.fencing("s", [(1, "a", 4)], ("a", 3))
    assert "above the lease's epoch 3" in bad[0].detail


def _ev(seq: int, kind: str, **payload: Any) -> dict[str, Any]:
    return {"sequence": seq, "type": kind, "payload": payload}


USAGE = {"input": 40, "output": 12, "cached_input": 20}


def _counted(u: dict[str, int]) -> dict[str, int]:
    return {"input": u["input"], "cached_input": u["cached_input"], "cache_write_input": 0,
            "output": u["output"], "reasoning_output": 0, "total": u["input"] + u["output"]}


def test_usage_is_counted_once_per_answer_and_adds_up() -> None:
    last = _counted(USAGE)
    good = [_ev(1, "agent_message", text="step 0"), _ev(2, "model_step_completed", step=1),
            _ev(3, "token_count", last=last, total=last)]
    scripted = {"step 0": [USAGE]}
    assert inv.usage_accounted("s", good, last, scripted) == []
    # a retried step counted twice (the plant usage_double_retry): last != the script's
    double = {k: 2 * v for k, v in last.items()}
    bad = [*good[:2], _ev(3, "token_count", last=double, total=double)]
    (v,) = inv.usage_accounted("s", bad, double, scripted)
    assert v.invariant == "usage_accounted"
    assert v.sequence == 3
    # a total that drifts from its parts, and a store total that is not their sum
    drift = [*good[:2], _ev(3, "token_count", last=last, total=double)]
    assert [v.sequence for v in inv.usage_accounted("s", drift, last, scripted)] == [3]
    assert [v.sequence for v in inv.usage_accounted("s", good, double, scripted)] == [None]


def test_one_answer_text_with_several_usages_takes_any_of_them() -> None:
    """The demo's script answers the same text with a different usage at each
    turn: the step counted one of them once (a false positive in the demo run
    before), and twice any of them is still caught."""
    other = {**USAGE, "input": 50}
    script = {"responses": [{"text": "step 0", "usage": USAGE},
                            {"text": "step 0", "usage": other}]}
    scripted = inv.scripted_usage(script)
    assert scripted == {"step 0": [USAGE, other]}
    last = _counted(other)
    good = [_ev(1, "agent_message", text="step 0"), _ev(2, "model_step_completed", step=1),
            _ev(3, "token_count", last=last, total=last)]
    assert inv.usage_accounted("s", good, last, scripted) == []
    double = {k: 2 * v for k, v in last.items()}
    bad = [*good[:2], _ev(3, "token_count", last=double, total=double)]
    assert [v.sequence for v in inv.usage_accounted("s", bad, double, scripted)] == [3]


def user_item(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def said_item(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": text}]}


def test_a_completed_turn_and_its_user_messages_are_in_the_stored_context() -> None:
    replay = [_ev(1, "user_message", text="u0"), _ev(2, "context_compacted", epoch=1),
              _ev(3, "turn_complete", last_agent_message="done 0"),
              _ev(4, "user_message", text="u1"),
              _ev(5, "turn_complete", last_agent_message="done 1")]
    context = [{"type": "compaction"}, user_item("u0"), said_item("done 0"), user_item("u1"),
               said_item("done 1")]
    assert inv.transcript_complete("s", replay, context) == []
    lost = [i for i in context if i != said_item("done 1")]
    assert [v.sequence for v in inv.transcript_complete("s", replay, lost)] == [5]
    # a compaction that lost the newest user message before it (compaction_drops_user)
    dropped = [i for i in context if i != user_item("u0")]
    (v,) = inv.transcript_complete("s", replay, dropped)
    assert v.invariant == "transcript_complete"
    assert v.sequence == 1


def test_an_export_is_the_stores_context_at_its_position() -> None:
    context = [user_item("u0"), said_item("step 0")]
    doc = {"content": {"logical_resume": {"session_id": "s", "messages": context,
                                          "position": {"epoch": 0, "at_batch": 1}}}}
    assert inv.export_matches_store("f.json", doc, context) == []
    (v,) = inv.export_matches_store("f.json", doc, [*context, said_item("step 1")])
    assert v.invariant == "export_matches_store"
    assert "differ from item 2" in v.detail
    assert inv.export_matches_store("f.json", doc, None)[0].invariant == "export_matches_store"


def test_an_ok_output_is_its_own_calls() -> None:
    replay = [
        _ev(1, "tool_call_begin", call_id="a", name="shell",
            arguments={"command": "echo m-0 >> effects.log && echo running m-0 && sleep 6"}),
        _ev(2, "tool_call_begin", call_id="b", name="write_file",
            arguments={"path": "files/f0.txt", "content": "x"}),
        _ev(3, "tool_call_begin", call_id="c", name="read_file",
            arguments={"path": "effects.log"}),
        _ev(4, "tool_call_end", call_id="b", outcome="ok", output="wrote 1 bytes to files/f0.txt"),
        _ev(5, "tool_call_end", call_id="c", outcome="ok", output="m-0\n"),
        _ev(6, "tool_call_end", call_id="a", outcome="ok", output="running m-0\n")]
    assert inv.outputs_match_calls("s", replay) == []
    # the shell's output handed to the write, the write's to the read
    swapped = [*replay[:3],
               _ev(4, "tool_call_end", call_id="b", outcome="ok", output="running m-0\n"),
               _ev(5, "tool_call_end", call_id="c", outcome="ok",
                   output="wrote 1 bytes to files/f0.txt"),
               _ev(6, "tool_call_end", call_id="a", outcome="unknown", output="lost")]
    assert [v.sequence for v in inv.outputs_match_calls("s", swapped)] == [4, 5]
