"""PostgreSQL lost while a farm runs: a turn with a sandboxed tool call in flight pauses
with a visible state (``describe`` says ``paused``, ``status`` counts it, subscribers get
the live ``store_status`` notice) while the server is down past the lease, and goes on
when it is back on the same port: the call ends ``ok`` (not re-run, not ``unknown``: the
supervisor kept its session under a new epoch), nothing uncommitted was shown, nothing
committed is lost. Held down past ``[store] outage_wait_s``, the next turn ends with the
typed failure ``store_unavailable``, recorded and shown once the server is back. Then
the session goes between owners (its lease taken by a supervisor that vanished): the
subscription is held, not ended, until this supervisor claims it, and goes on. Last,
the supervisor is stopped while a turn is paused: it exits by itself at once, its
restart waits for PostgreSQL (no restart loop), and resumes the turn from what was
committed.

The cluster is this module's own (the shared one serves other tests) and is stopped by
its postmaster pid."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.client import SupervisorClient
from supervisor.devtools.pgserver import PgServer
from tests.conftest import running_pg
from tests.farm.midturn import has_event as _has
from tests.helpers import eventually

pytestmark = pytest.mark.timeout(240)
LEASE_S = 1.0
OUTAGE_WAIT_S = 6.0


@pytest.fixture(scope="module")
def own_pg() -> Iterator[PgServer]:
    """A cluster of the module's own: its tests stop and restart it."""
    yield from running_pg()


async def _says(path: Path, text: str, times: int = 1) -> bool:
    def read() -> str:
        return path.read_text(errors="replace") if path.exists() else ""
    return (await asyncio.to_thread(read)).count(text) >= times


def _durable(seen: list[dict[str, Any]]) -> list[int]:
    return [e["sequence"] for e in seen if e["sequence"] > 0]


def _ended(seen: list[dict[str, Any]], sub: str) -> list[dict[str, Any]]:
    return [e for e in seen if e.get("submission_id") == sub
            and e["type"] in ("turn_complete", "turn_aborted")]


async def _has_ended(seen: list[dict[str, Any]], sub: str) -> bool:
    return _ended(seen, sub) != []


async def _notices(seen: list[dict[str, Any]], n: int) -> bool:
    return sum(e["type"] == "store_status" for e in seen) >= n


async def _began(seen: list[dict[str, Any]], n: int) -> bool:
    return sum(e["type"] == "tool_call_begin" for e in seen) == n


async def test_a_turn_pauses_while_postgresql_is_down_and_goes_on_when_it_is_back(
        start_farm: Callable[..., Any], workspace_root: Path, own_pg: PgServer) -> None:
    url = own_pg.new_database()
    db = url.rsplit("/", 1)[1]
    ws = workspace_root / "ws"
    ws.mkdir()
    script = {"responses": [
        {"tool_calls": [{"name": "shell",
                         "arguments": {"command": "echo run >> runs.txt; sleep 3; echo slow"}}]},
        {"text": "finished", "usage": {"input": 10, "output": 3}},
        {"tool_calls": [{"name": "shell",
                         "arguments": {"command": "echo two >> runs.txt; sleep 1; echo quick"}}]},
        {"text": "the third turn's answer", "usage": {"input": 10, "output": 3}},
        {"tool_calls": [{"name": "shell",
                         "arguments": {"command": "echo four >> runs.txt; sleep 1"}}]},
        {"text": "the fourth turn's answer", "usage": {"input": 10, "output": 3}},
    ]}
    farm = await start_farm(script, extra=f'[store]\nurl = "{url}"\nlease_s = {LEASE_S}\n'
                                          f'outage_wait_s = {OUTAGE_WAIT_S}\n')
    supervisor_pid = farm.pid("supervisor")
    async with SupervisorClient(farm.endpoint) as sv:
        sid = await sv.create_session(workspace=str(ws))
        seen: list[dict[str, Any]] = []

        async def collect() -> None:
            async for e in sv.events(sid):
                seen.append(e)

        collector = asyncio.create_task(collect())
        try:
            # 1. Down past the lease while the tool call runs, then back: the turn goes on.
            sub = await sv.submit(sid, {"type": "user_input", "text": "go"})
            await eventually(lambda: _has(seen, "tool_call_begin"), timeout_s=30,
                             what="the tool call to start")
            await asyncio.to_thread(own_pg.kill)
            # The notice is published after everything committed before the outage, on
            # the same ordered stream: once it is seen, so is all of that.
            await eventually(lambda: _notices(seen, 1), timeout_s=30,
                             what="the store_status notice")
            shown_at_kill = _durable(seen)

            async def paused_past_lease() -> bool:
                d = await sv.describe(sid)
                outage = d.get("store_outage") or {}
                return d["status"] == "paused" and outage.get("waited_s", 0) > 2 * LEASE_S

            await eventually(paused_past_lease, timeout_s=30,
                             what="the session to be paused past its lease")
            stats = (await sv.status())["sessions"]
            assert stats["sessions_paused_store"] == 1, stats
            notices = [e for e in seen if e["type"] == "store_status"]
            assert [n["payload"]["state"] for n in notices] == ["unavailable"], notices
            assert notices[0]["sequence"] == 0  # a live notice, never journaled
            # Nothing that is not committed is shown: the call's end waits for the store.
            assert _durable(seen) == shown_at_kill
            assert not any(e["type"] == "tool_call_end" for e in seen)

            await asyncio.to_thread(own_pg.restart)
            await eventually(lambda: _has_ended(seen, sub), timeout_s=60,
                             what="the turn to end after PostgreSQL came back")
            assert [e["type"] for e in _ended(seen, sub)] == ["turn_complete"]
            ends = [e for e in seen if e["type"] == "tool_call_end"]
            assert [e["payload"]["outcome"] for e in ends] == ["ok"], ends
            assert (ws / "runs.txt").read_text() == "run\n"  # ran once
            assert [n["payload"]["state"] for n in seen if n["type"] == "store_status"] \
                == ["unavailable", "available"]
            described = await sv.describe(sid)
            assert described["status"] != "paused"
            assert "store_outage" not in described
            lease = own_pg.psql("SELECT epoch FROM leases", database=db).split()
            assert len(lease) == 1, lease
            assert int(lease[0]) >= 2, lease  # kept, under a new epoch

            # 2. Down past outage_wait_s: the turn ends store_unavailable, shown once back.
            sub2 = await sv.submit(sid, {"type": "user_input", "text": "again"})
            await eventually(lambda: _began(seen, 2),
                             timeout_s=30, what="the second tool call to start")
            await asyncio.to_thread(own_pg.kill)
            await eventually(lambda: _notices(seen, 3), timeout_s=30,
                             what="the second store_status notice")
            shown_at_kill = _durable(seen)

            async def reporting() -> bool:
                outage = (await sv.describe(sid)).get("store_outage") or {}
                return bool(outage.get("reporting_failure"))

            await eventually(reporting, timeout_s=OUTAGE_WAIT_S + 30,
                             what="the turn to pass outage_wait_s")
            assert _durable(seen) == shown_at_kill  # its failure is not shown before it is
            assert _ended(seen, sub2) == []         # committed
            await asyncio.to_thread(own_pg.restart)
            await eventually(lambda: _has_ended(seen, sub2), timeout_s=60,
                             what="the turn's failure to be recorded once PostgreSQL is back")

            # 3. Between owners: another supervisor took the lease and vanished before
            # advertising itself. This one gives the session up (its subscriber is
            # dropped, and resubscribes here); the subscription is held, not ended.
            # The lease outlives one hold (2 x lease + 1.5 s = 3.5 s): the hold ends
            # between_owners and the client library subscribes again, held again until
            # this supervisor claims the session, then it goes on with no gap and no
            # duplicate.
            shown_before = len(_durable(seen))
            own_pg.psql("UPDATE leases SET owner = 'sv-gone', epoch = epoch + 1, expires_at ="
                        " extract(epoch from clock_timestamp()) + 5", database=db)
            log = farm.home / "logs" / "supervisor.log"
            await eventually(lambda: _says(log, "its subscription is held", times=2),
                             timeout_s=30, what="the resubscription held twice")

            async def claimed_here() -> bool:
                return "sv-gone" not in own_pg.psql("SELECT owner FROM leases", database=db)

            await eventually(claimed_here, timeout_s=30, what="the session to be claimed")
            assert not collector.done(), collector  # held, never ended
            sub3 = await sv.submit(sid, {"type": "user_input", "text": "third"})
            await eventually(lambda: _has_ended(seen, sub3), timeout_s=60,
                             what="the third turn to end, seen through the held subscription")
            assert len(_durable(seen)) > shown_before

            # 4. Stopped while paused: the waits are abandoned and the process exits by
            # itself (status 0, not killed by the tree after its 10 s); restarted once
            # PostgreSQL is back, it resumes the turn from what was committed.
            sub4 = await sv.submit(sid, {"type": "user_input", "text": "fourth"})
            await eventually(lambda: _began(seen, 3), timeout_s=30,
                             what="the fourth tool call to start")
            await asyncio.to_thread(own_pg.kill)

            async def paused() -> bool:
                return bool((await sv.describe(sid))["status"] == "paused")

            await eventually(paused, timeout_s=30, what="the fourth turn to pause")
            child = farm.farm.tree.children["supervisor"]
            os.kill(supervisor_pid, signal.SIGTERM)

            async def stopped_by_itself() -> bool:
                return child.pid != supervisor_pid and child.last_exit is not None

            await eventually(stopped_by_itself, timeout_s=30, what="the supervisor to stop")
            assert child.last_exit == 0, child.last_exit
            restarts = child.restarts
            # Its restart waits for the store (it does not exit 2 into a restart loop
            # that would make the tree give the farm up).
            await eventually(lambda: _says(log, "waiting up to"), timeout_s=60,
                             what="the restarted supervisor to wait for PostgreSQL")
            await asyncio.to_thread(own_pg.restart)
            await eventually(lambda: _has_ended(seen, sub4), timeout_s=90,
                             what="the fourth turn to end after the restart")
        finally:
            collector.cancel()
        history = (await sv.history(sid))["events"]
        described = await sv.describe(sid)
    end = _ended(seen, sub2)
    assert [e["type"] for e in end] == ["turn_aborted"], end
    assert end[0]["payload"]["reason"] == "failed", end
    errors = [e["payload"] for e in seen if e["type"] == "error"
              and e.get("submission_id") == sub2]
    assert [e["kind"] for e in errors] == ["store_unavailable"], errors
    assert errors[0]["retryable"] is True
    assert described["status"] == "idle"
    assert "store_outage" not in described
    # Nothing committed was lost, and what was shown is exactly what is committed.
    durable = _durable(seen)
    assert durable == list(range(1, len(durable) + 1)), "gap or duplicate"
    assert [e["sequence"] for e in history] == durable
    assert [(e["type"], e["payload"]) for e in history] == \
        [(e["type"], e["payload"]) for e in seen if e["sequence"] > 0]
    assert [e["type"] for e in _ended(seen, sub3)] == ["turn_complete"]
    assert [e["type"] for e in _ended(seen, sub4)] == ["turn_complete"]
    assert child.restarts == restarts  # one start, which waited: no exit meanwhile
    fourth = [e for e in seen if e["type"] == "tool_call_end"][-1]
    assert fourth["payload"]["outcome"] == "unknown", fourth  # its end was not committed
    assert (ws / "runs.txt").read_text() == "run\ntwo\nfour\n"  # nothing re-run
    own_pg.drop_database(url)
