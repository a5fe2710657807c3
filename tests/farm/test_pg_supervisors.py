"""Two real supervisors on one PostgreSQL store: the one running a turn is SIGSTOPped
past its lease; the other takes the session over within lease + margin and finishes
the turn as after a restart (the tool call in flight is reported, never re-run); the
stopped one, woken by SIGCONT, has its writes refused and gives the session up
without publishing anything. A client of the other supervisor, redirected to the
stopped owner, follows the session to its new owner with no gap and no duplicate."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from supervisor.client import SupervisorClient
from tests.farm.conftest import write_home
from tests.farm.midturn import collecting, has_event, signal_in_tool_call, turn_ended
from tests.helpers import Procs, eventually, read_ready

pytestmark = pytest.mark.timeout(180)
LEASE_S = 2.0
MARGIN_S = 3.0


async def test_a_supervisor_paused_past_its_lease_loses_the_session_to_another(
        start_farm: Callable[..., Any], workspace_root: Path, pg_server: Any,
        procs: Procs, tmp_path: Path) -> None:
    url = pg_server.new_database()
    ws = workspace_root / "ws"
    ws.mkdir()
    script = {"responses": [
        {"tool_calls": [{"name": "shell",
                         "arguments": {"command": "echo run >> runs.txt; sleep 4; echo slow"}}]},
        {"text": "finished", "usage": {"input": 10, "output": 3}},
    ]}
    extra = f'[store]\nurl = "{url}"\nlease_s = {LEASE_S}\n'
    stopped: int | None = None
    try:
        farm = await start_farm(script, extra=extra)
        await _start_b(farm, procs, tmp_path, script, extra, "DEBUG")

        # a_only: A's own publications (not followed to B when A gives the session up)
        async with SupervisorClient(farm.endpoint) as a, \
                SupervisorClient(farm.endpoint, follow_redirects=False) as a_only, \
                SupervisorClient(f"ipc://{tmp_path}/b.sock") as b:
            sid = await a.create_session(workspace=str(ws))
            sub = await a.submit(sid, {"type": "user_input", "text": "go"})
            a_ended: list[str] = []  # A gave the session up: its subscriber told, not left
            # A client of B follows the session: redirected to A, its owner, then (A
            # frozen) back to B, which names no one until the lease lapsed, then owns it.
            async with collecting(a_only, sid, ended=a_ended) as seen_a, \
                    collecting(b, sid) as seen_via_b:
                await eventually(lambda: has_event(seen_via_b, "tool_call_begin"),
                                 timeout_s=30, what="B's client to see the call, through A")
                stopped = await signal_in_tool_call(
                    farm, seen_a, signal.SIGSTOP, "the tool call to start on supervisor A")
                paused_at = time.monotonic()
                seen_a_at_stop = len(seen_a)

                before = len((await b.history(sid))["events"])

                async def progressed() -> bool:  # B's first write after the pause
                    return len((await b.history(sid))["events"]) > before

                await eventually(progressed, timeout_s=LEASE_S + MARGIN_S + 5,
                                 what="supervisor B to take the session over")
                takeover_s = time.monotonic() - paused_at
                status = (await b.status())["supervisors"]
                assert status["self"] == "sv-b"
                owners = {o["id"]: o for o in status["owners"]}
                assert owners["sv-b"]["sessions"] == 1, status
                assert 0 <= owners["sv-b"]["renewed_s_ago"] <= LEASE_S, status

                async def ended() -> bool:
                    return await turn_ended((await b.history(sid))["events"], sub)

                await eventually(ended, timeout_s=60, what="the turn to end on supervisor B")
                await eventually(lambda: turn_ended(seen_via_b, sub), timeout_s=30,
                                 what="B's client to see the turn end (owner changed)")
                os.kill(stopped, signal.SIGCONT)
                stopped = None
                log_a = farm.home / "logs" / "supervisor.log"
                await eventually(lambda: _says(log_a, "lease lost; given up"), timeout_s=30,
                                 what="supervisor A to give the session up")
                # its subscriber is told (it once waited forever on an empty queue)
                async def told() -> bool:
                    return bool(a_ended)

                await eventually(told, timeout_s=30,
                                 what="A's subscription to end once A gave the session up")
                assert a_ended[0] in ("moved", "unknown_session", "closed"), a_ended
                history = await b.history(sid)
        assert takeover_s <= LEASE_S + MARGIN_S + 1.0, takeover_s
        events = history["events"]
        assert [e["sequence"] for e in events] == list(range(1, len(events) + 1))
        # The subscription that changed owners: no gap, no duplicate, all of the history.
        assert [e["sequence"] for e in seen_via_b if e["sequence"] > 0] == \
            [e["sequence"] for e in events]
        ends = [e for e in events if e["type"] == "tool_call_end"]
        assert len(ends) == 1
        assert ends[0]["payload"]["outcome"] == "unknown", ends[0]
        assert (ws / "runs.txt").read_text() == "run\n"  # never re-run
        turn_end = [e for e in events if e["type"] in ("turn_complete", "turn_aborted")]
        assert [e["type"] for e in turn_end] == ["turn_complete"]
        # Supervisor A published nothing after it was stopped (and woken): no live
        # event, and no durable one that the store does not hold as it was shown. (A
        # resubscription that A, woken, answered before it knew of the loss replays
        # what B committed, from the store: committed events, not A's publications.)
        late = seen_a[seen_a_at_stop:]
        assert not [e for e in late if e["sequence"] == 0], late
        by_seq = {e["sequence"]: (e["type"], e["payload"]) for e in events}
        assert all(by_seq[e["sequence"]] == (e["type"], e["payload"]) for e in late)
        durable_a = [e["sequence"] for e in seen_a if e["sequence"] > 0]
        assert durable_a == list(range(1, len(durable_a) + 1))
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        pg_server.drop_database(url)


async def _start_b(farm: Any, procs: Procs, tmp_path: Path, script: dict[str, Any],
                   extra: str, log_level: str) -> subprocess.Popen[bytes]:
    """A second supervisor, ``sv-b``, on the farm's broker and store (a home of its
    own, the farm's scripted provider), serving at ``ipc://TMP/b.sock``; once ready."""
    llm = farm.farm.tree.ready_lines()["fakellm-s"]["url"]
    home_b = tmp_path / "home-b"
    write_home(home_b, script, extra=extra)
    b_proc = procs.python(
        "supervisor", "--home", str(home_b), "--broker", farm.farm.paths.broker_frontend,
        "--listen", f"ipc://{tmp_path}/b.sock", "--route-url", f"s={llm}",
        "--supervisor-id", "sv-b", "--log-level", log_level, name="supervisor-b",
        stdout=subprocess.PIPE)
    await asyncio.to_thread(read_ready, b_proc, 90.0)
    return b_proc


async def _says(path: Path, text: str) -> bool:
    def read() -> str:
        return path.read_text(errors="replace") if path.exists() else ""
    return text in await asyncio.to_thread(read)


SIGNED_LEASE_S = 10.0  # long: a session moved within half of it was released, not lapsed


async def test_a_supervisor_stopped_cleanly_hands_its_sessions_over_at_once(
        start_farm: Callable[..., Any], workspace_root: Path, pg_server: Any,
        procs: Procs, tmp_path: Path) -> None:
    """SIGTERM of one of two supervisors: once it exited, the other owns its session
    within half a lease (its leases were released, not left to lapse), serves its next
    turn, and new sessions are no longer placed on the stopped one."""
    url = pg_server.new_database()
    ws = workspace_root / "ws"
    ws.mkdir()
    script = {"responses": [{"text": "one"}, {"text": "two"}, {"text": "three"}]}
    extra = f'[store]\nurl = "{url}"\nlease_s = {SIGNED_LEASE_S}\n'
    try:
        farm = await start_farm(script, extra=extra)
        b_proc = await _start_b(farm, procs, tmp_path, script, extra, "INFO")
        async with SupervisorClient(farm.endpoint) as a:
            a_id = (await a.status())["supervisors"]["self"]
        async with SupervisorClient(f"ipc://{tmp_path}/b.sock") as b:
            sid = await b.create_session(workspace=str(ws))  # a tie: created on B
            assert (await b.status())["supervisors"]["self"] == "sv-b"
            first = await b.submit(sid, {"type": "user_input", "text": "go"})

            async def first_ended() -> bool:
                return await turn_ended((await b.history(sid))["events"], first)

            await eventually(first_ended, timeout_s=60, what="the turn on supervisor B")
        assert _owner(url, sid) == "sv-b"
        b_proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(b_proc.wait, 30)
        stopped_at = time.monotonic()
        assert b_proc.returncode == 0, procs.log(b_proc)[-2000:]

        async def moved() -> bool:
            return await asyncio.to_thread(_owner, url, sid) == a_id

        await eventually(moved, timeout_s=SIGNED_LEASE_S + 10,
                         what="supervisor 1 to own the stopped supervisor's session")
        moved_s = time.monotonic() - stopped_at
        assert moved_s < SIGNED_LEASE_S / 2, f"taken {moved_s:.1f}s after the stop: lapsed"
        async with SupervisorClient(farm.endpoint) as a:
            second = await a.submit(sid, {"type": "user_input", "text": "again"})

            async def second_ended() -> bool:
                return await turn_ended((await a.history(sid))["events"], second)

            await eventually(second_ended, timeout_s=60, what="the next turn on supervisor 1")
            # Placement: supervisor 1 holds one session, the stopped one none; a new
            # session is created here, not sent to the stopped supervisor's address.
            async with asyncio.timeout(20):
                other = await a.create_session(workspace=str(ws))
        assert await asyncio.to_thread(_owner, url, other) == a_id
    finally:
        pg_server.drop_database(url)


def _owner(url: str, session_id: str) -> str | None:
    """The owner of ``session_id``'s live lease, read from PostgreSQL."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT l.owner FROM leases l JOIN sessions s ON s.sid = l.sid WHERE"
            " s.session_id = %s AND l.expires_at > extract(epoch from clock_timestamp())",
            (session_id,)).fetchone()
    return None if row is None else str(row[0])
