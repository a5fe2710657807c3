"""Approvals: the policy rules (pure), and the live flow through a real farm:
one request per batch, approve / approved_for_session / deny / abort, stale
responses, a pending approval that survives a supervisor restart, and a
timeout that counts from the request across one.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from supervisor.engine import HookInput, HookResult, Middleware
from supervisor.engine.approvals import Decision, call_key, parse_policy, parse_rule
from supervisor.engine.session import PendingApproval
from supervisor.store.records import EventRecord
from tests.engine.farm import Engine, Farm, FarmPool, engine, types
from tests.helpers import Procs

# The farms' brokers and workers are shared by the module (conftest.py's
# ``farm_pool``), also under xdist (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("engine-approvals")

# ------------------------------------------------------------------- pure


def test_rules_are_checked_deny_then_allow_then_ask() -> None:
    policy = parse_policy({"default": "deny", "deny": ["shell(rm *)"],
                           "allow": ["shell(git status*)", "shell(rm -i *)"],
                           "ask": ["shell(git *)"]})
    assert policy.decide("shell", {"command": "git status --short"})[0] is Decision.ALLOW
    assert policy.decide("shell", {"command": "git push"})[0] is Decision.ASK
    assert policy.decide("shell", {"command": "rm -i x"})[0] is Decision.DENY  # deny first
    assert policy.decide("shell", {"command": "ls"})[0] is Decision.DENY  # default
    assert policy.decide("read_file", {"path": "a"})[0] is Decision.ALLOW  # read-only


def test_read_only_tools_can_follow_the_default() -> None:
    policy = parse_policy({"default": "ask", "read_only": None})
    assert policy.decide("read_file", {"path": "a"})[0] is Decision.ASK
    assert parse_policy({"allow": ["read_file(*)"], "read_only": None}).decide(
        "read_file", {"path": "x"})[0] is Decision.ALLOW


def test_approved_for_session_remembers_the_exact_call_only() -> None:
    policy = parse_policy("ask")
    approved = frozenset({call_key("shell", {"command": "rm -rf build"})})
    assert policy.decide("shell", {"command": "rm -rf build"}, approved)[0] is Decision.ALLOW
    assert policy.decide("shell", {"command": "rm -rf /"}, approved)[0] is Decision.ASK
    deny = parse_policy({"deny": ["shell(rm*)"]})
    assert deny.decide("shell", {"command": "rm -rf build"}, approved)[0] is Decision.DENY


@pytest.mark.parametrize("bad", ["", "shell(", "(x)", 3, {"default": "maybe"},
                                 {"deny": "shell(*)"}, {"unknown": []}])
def test_malformed_policies_are_refused(bad: Any) -> None:
    check = parse_rule if isinstance(bad, str | int) else parse_policy
    with pytest.raises((ValueError, TypeError)):
        check(bad)


async def test_the_time_since_a_request_never_goes_negative() -> None:
    # a request stored "in the future": the wall clock was stepped back since
    assert PendingApproval("a", "t", requested_at=time.time() + 3600).elapsed_s() == 0.0
    elapsed = PendingApproval("a", "t", requested_at=time.time() - 10).elapsed_s()
    assert elapsed is not None
    assert 10.0 <= elapsed < 11.0
    assert PendingApproval("a", "t").elapsed_s() is None  # unknown
    # in the requesting process the monotonic clock wins over the wall clock
    here = PendingApproval("a", "t", requested_at=time.time() - 100,
                           requested_mono=time.monotonic())
    assert (here.elapsed_s() or 0.0) < 1.0


# ------------------------------------------------------------------- live

TWO_CALLS = {"responses": [
    {"tool_calls": [{"name": "shell", "call_id": "a", "arguments": {"command": "echo A"}},
                    {"name": "shell", "call_id": "b", "arguments": {"command": "echo B"}}]},
    {"text": "done"},
    {"tool_calls": [{"name": "shell", "call_id": "c", "arguments": {"command": "echo A"}}]},
    {"text": "done again"}]}


async def until_approval(eng: Engine, sid: str, text: str) -> tuple[EventRecord, str]:
    it = eng.manager.subscribe(sid)  # type: ignore[arg-type]
    sub = await eng.manager.submit(sid, {"type": "user_input", "text": text})  # type: ignore[arg-type]
    async with asyncio.timeout(20):
        async for e in it:
            if e.submission_id == sub and e.type == "exec_approval_request":
                await it.aclose()  # type: ignore[attr-defined]
                return e, sub
    raise AssertionError("no approval request")


async def finish(eng: Engine, sid: str, sub: str, op: dict[str, Any] | None,
                 after: int) -> list[EventRecord]:
    events = await eng.run_until(
        sid, op,  # type: ignore[arg-type]
        until=lambda e: e.submission_id == sub and e.type in ("turn_complete", "turn_aborted"),
        after_sequence=after)
    return [e for e in events if e.submission_id == sub]


@pytest.mark.sandbox
async def test_one_request_covers_the_batch_and_approved_for_session_is_remembered(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    farm = farm_pool.farm(procs, tmp_path, TWO_CALLS)
    async with engine(farm) as eng:
        sid = await eng.session(approval="ask")
        request, sub = await until_approval(eng, sid, "run both")
        assert [c["call_id"] for c in request.payload["calls"]] == ["a", "b"]
        saved = await eng.store.load(sid)
        assert saved is not None
        assert saved.state.pending_approval is not None
        assert saved.state.pending_approval["id"] == request.payload["id"]
        events = await finish(eng, sid, sub, {"type": "exec_approval", "id": request.payload["id"],
                                              "decision": "approved_for_session"},
                              request.sequence)
        assert events[-1].type == "turn_complete"
        assert sorted(e.payload["output"].strip() for e in events
                      if e.type == "tool_call_end") == ["A", "B"]
        # the same exact call is not asked again
        last = (await eng.store.replay_events(sid))[-1].sequence
        second = await eng.run_until(sid, {"type": "user_input", "text": "again"},
                                     after_sequence=last)
        assert "exec_approval_request" not in types(second)
        assert [e.payload["output"].strip() for e in second if e.type == "tool_call_end"] == ["A"]


@pytest.mark.sandbox
@pytest.mark.parametrize("decision", ["denied", "abort"])
async def test_denied_and_aborted_approvals(procs: Procs, farm_pool: FarmPool, tmp_path: Path,
                                            decision: str) -> None:
    farm = farm_pool.farm(procs, tmp_path, TWO_CALLS)
    async with engine(farm) as eng:
        sid = await eng.session(approval="ask")
        request, sub = await until_approval(eng, sid, "run both")
        events = await finish(eng, sid, sub, {"type": "exec_approval",
                                              "id": request.payload["id"],
                                              "decision": decision}, request.sequence)
        if decision == "denied":
            assert events[-1].type == "turn_complete"
            ends = [e.payload for e in events if e.type == "tool_call_end"]
            assert [(p["outcome"], p["is_error"]) for p in ends] == [("deny", True)] * 2
            assert "tool_call_begin" not in types(events)
        else:
            assert events[-1].type == "turn_aborted"
            assert events[-1].payload["reason"] == "rejected"
        saved = await eng.store.load(sid)
        assert saved is not None
        assert saved.state.pending_approval is None
        calls = [i["call_id"] for i in saved.context if i.get("type") == "function_call"]
        outputs = [i["call_id"] for i in saved.context if i.get("type") == "function_call_output"]
        assert sorted(calls) == sorted(outputs) == ["a", "b"]


@pytest.mark.sandbox
async def test_an_answer_is_durable_when_its_submit_returns(procs: Procs, farm_pool: FarmPool,
                                                           tmp_path: Path) -> None:
    # Found by corral chaos: a supervisor killed right after acknowledging an
    # answer lost it (the resumed turn denied the calls as unanswered). The
    # submit now returns only once the verdicts are committed.
    farm = farm_pool.farm(procs, tmp_path, TWO_CALLS)
    async with engine(farm) as eng:
        sid = await eng.session(approval="ask")
        request, sub = await until_approval(eng, sid, "run both")
        await eng.manager.submit(sid, {"type": "exec_approval",  # type: ignore[arg-type]
                                       "id": request.payload["id"], "decision": "approved"})
        # nothing awaited since the submit returned: the turn has already applied it
        assert eng.manager.sessions[sid].state.pending_approval is None  # type: ignore[index]
        saved = await eng.store.load(sid)  # and it is on disk
        assert saved is not None
        assert saved.state.pending_approval is None
        assert all(pc["verdict"] == "allow" for pc in saved.state.pending_tool_calls)
        events = await finish(eng, sid, sub, None, request.sequence)
        assert events[-1].type == "turn_complete"


async def test_stale_approval_is_a_warning(procs: Procs, farm_pool: FarmPool,
                                           tmp_path: Path) -> None:
    farm = farm_pool.farm(procs, tmp_path, {"responses": [{"text": "hi"}]}, services="model")
    async with engine(farm) as eng:
        sid = await eng.session()
        events = await eng.run_until(sid, {"type": "exec_approval", "id": "approval_old",
                                           "decision": "approved"},
                                     until=lambda e: e.type == "warning")
        assert events[-1].payload["message"] == "approval response targeted a stale request"
        done = await eng.run_until(sid, {"type": "user_input", "text": "still alive?"})
        assert done[-1].type == "turn_complete"


class DenyAllPermissions(Middleware):
    name = "deny_all"

    async def permission_request(self, inp: HookInput) -> HookResult | None:
        return HookResult(deny="policy says no")


class AllowAllPermissions(Middleware):
    name = "allow_all"

    async def permission_request(self, inp: HookInput) -> HookResult | None:
        return HookResult(allow=True)


async def test_permission_hook_deny_cannot_be_weakened_by_a_later_allow(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    farm = farm_pool.farm(procs, tmp_path, TWO_CALLS, services="model")
    mws = [DenyAllPermissions(), AllowAllPermissions()]
    async with engine(farm, middleware=lambda spec: mws) as eng:
        sid = await eng.session(approval="ask")
        events = await eng.run_until(sid, {"type": "user_input", "text": "run"})
        assert events[-1].type == "turn_complete"
        assert "exec_approval_request" not in types(events)
        ends = [e.payload for e in events if e.type == "tool_call_end"]
        assert all("policy says no" in p["output"] for p in ends)
        assert len(ends) == 2


@pytest.mark.sandbox
async def test_pending_approval_survives_a_supervisor_restart(procs: Procs, farm_pool: FarmPool,
                                                              tmp_path: Path) -> None:
    farm = farm_pool.farm(procs, tmp_path, TWO_CALLS)
    db = tmp_path / "restart.sqlite3"
    async with engine(farm, db=db) as eng:
        sid = await eng.session(approval="ask")
        request, sub = await until_approval(eng, sid, "run both")
    # the supervisor is gone; a new one opens the same store and resumes
    async with engine(farm, db=db) as eng2:
        described = await eng2.manager.describe(sid)
        assert described["pending_approval"]["id"] == request.payload["id"]
        events = await finish(eng2, sid, sub, {"type": "exec_approval",
                                               "id": request.payload["id"],
                                               "decision": "approved"}, request.sequence)
        assert events[-1].type == "turn_complete"
        assert sorted(e.payload["output"].strip() for e in events
                      if e.type == "tool_call_end") == ["A", "B"]
        replay = await eng2.store.replay_events(sid)
        assert [e.sequence for e in replay] == list(range(1, len(replay) + 1))
        assert types(replay).count("exec_approval_request") == 1


@pytest.mark.sandbox
async def test_an_unanswered_approval_times_out_as_a_denial(procs: Procs, farm_pool: FarmPool,
                                                           tmp_path: Path) -> None:
    farm = farm_pool.farm(procs, tmp_path, TWO_CALLS)
    async with engine(farm, approval_timeout_s=1.0) as eng:
        sid = await eng.session(approval="ask")
        request, sub = await until_approval(eng, sid, "run both")
        events = await finish(eng, sid, sub, None, request.sequence)  # nobody answers
        assert events[-1].type == "turn_complete"  # the model read the denials and answered
        (warning,) = [e.payload for e in events if e.type == "warning"]
        assert warning["approval_id"] == request.payload["id"]
        assert "not answered within 1s" in warning["message"]
        ends = [e.payload for e in events if e.type == "tool_call_end"]
        assert [(p["outcome"], p["is_error"]) for p in ends] == [("deny", True)] * 2
        assert all("not answered within 1s" in p["output"] for p in ends)
        assert "tool_call_begin" not in types(events)
        # an answer that comes too late is a stale one
        late = await eng.run_until(sid, {"type": "exec_approval", "id": request.payload["id"],
                                         "decision": "approved"},
                                   until=lambda e: e.type == "warning",
                                   after_sequence=events[-1].sequence)
        assert late[-1].payload["message"] == "approval response targeted a stale request"


async def approval_across_downtime(farm: Farm, db: Path, down_s: float, **config: Any
                                   ) -> tuple[str, EventRecord, str, float]:
    """Start a turn that waits for an approval, stop the supervisor, and keep it
    down until ``down_s`` after the request. Returns (session, request event,
    submission, when the downtime ended); the caller then starts an engine on
    ``db`` again. The sleep is the downtime being simulated, not a wait for a
    condition."""
    async with engine(farm, db=db, **config) as eng:
        sid = await eng.session(approval="ask")
        request, sub = await until_approval(eng, sid, "run both")
    await asyncio.sleep(max(0.0, request.created_at + down_s - time.time()))
    return sid, request, sub, time.time()


@pytest.mark.sandbox
@pytest.mark.timeout(60)
@pytest.mark.parametrize("down_s", [3.0, 5.0], ids=["restart_before_deadline",
                                                    "restart_after_deadline"])
async def test_the_approval_timeout_counts_from_the_request_across_a_restart(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path, down_s: float) -> None:
    timeout_s = 4.0
    farm = farm_pool.farm(procs, tmp_path, TWO_CALLS)
    db = tmp_path / "deadline.sqlite3"
    sid, request, sub, restarted = await approval_across_downtime(
        farm, db, down_s, approval_timeout_s=timeout_s)
    requested_at = request.created_at
    async with engine(farm, db=db, approval_timeout_s=timeout_s) as eng2:
        events = await finish(eng2, sid, sub, None, request.sequence)  # nobody answers
    assert events[-1].type == "turn_complete"
    (warning,) = [e for e in events if e.type == "warning"]
    assert warning.payload["approval_id"] == request.payload["id"]
    assert "not answered within 4s" in warning.payload["message"]  # as a normal timeout
    ends = [e.payload for e in events if e.type == "tool_call_end"]
    assert [(p["outcome"], p["is_error"]) for p in ends] == [("deny", True)] * 2
    assert "tool_call_begin" not in types(events)
    # Never before the original deadline; at it (restart before it) or at once
    # (restart after it). A timeout counted afresh would end no earlier than
    # restarted + timeout_s: 7 s (resp. 9 s) after the request, against the
    # bound of 5.5 s (resp. 6.5 s) here; 1.5 s is the allowance for a loaded
    # machine's resume and commit.
    deadline = requested_at + timeout_s
    assert warning.created_at >= deadline - 0.05
    assert warning.created_at < max(deadline, restarted) + 1.5, (
        warning.created_at - requested_at, restarted - requested_at)


@pytest.mark.sandbox
@pytest.mark.timeout(60)
async def test_the_turn_limit_counts_from_the_turn_start_across_a_restart(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    """max_turn_s counts from the turn's stored start: a turn left waiting for an
    approval across a restart ends at its original limit, not a whole limit
    after the restart (so periodic restarts cannot keep a turn alive forever)."""
    limit_s = 5.0
    farm = farm_pool.farm(procs, tmp_path, TWO_CALLS)
    db = tmp_path / "limit.sqlite3"
    sid, request, sub, restarted = await approval_across_downtime(
        farm, db, 3.0, max_turn_s=limit_s)
    async with engine(farm, db=db, max_turn_s=limit_s) as eng2:
        events = await finish(eng2, sid, sub, None, 0)  # nobody answers
        loaded = await eng2.manager.store.load(sid)  # type: ignore[arg-type]
    assert loaded is not None
    (started,) = [e for e in events if e.type == "turn_started"]
    assert events[-1].type == "turn_aborted"
    assert events[-1].payload["reason"] == "failed"
    error = next(e for e in events if e.type == "error" and e.sequence > request.sequence)
    assert error.payload["kind"] == "turn_limit"
    # both calls of the batch are closed in the context, and neither ran
    outputs = [i for i in loaded.context if i.get("type") == "function_call_output"]
    assert len(outputs) == 2
    assert all("Tool call not completed" in str(i["output"]) for i in outputs)
    assert "tool_call_begin" not in types(events)
    # At the original limit (the turn started before the request, so by request +
    # 5 s); counted afresh it would end no earlier than restarted + 5 s = request
    # + 8 s. 1.5 s is the allowance for a loaded machine's resume and commit.
    ended = events[-1].created_at
    assert ended >= started.created_at + limit_s - 0.05
    assert ended < max(started.created_at + limit_s, restarted) + 1.5, (
        ended - started.created_at, restarted - started.created_at)
