"""``corral up --supervisors 2`` on a real PostgreSQL (one farm for the module, started
and stopped by the CLI): each supervisor is its own child with its own client endpoint,
lease owner id and broker identity, so turns run on both at once; farm.json and
``corral status`` list both endpoints; a SIGKILLed supervisor is restarted alone. And
more than one supervisor without ``[store] url`` is a typed config error."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from supervisor.client import SupervisorClient, SupervisorError
from tests.cli.test_cli_e2e import corral, events_of, make_ws
from tests.farm.conftest import write_home
from tests.helpers import Procs, eventually, read_ready

pytestmark = pytest.mark.timeout(240)
SCRIPT = {"responses": [
    {"tool_calls": [{"name": "shell", "arguments": {"command": "echo hi"}}]},
    *[{"text": "done", "usage": {"input": 10, "output": 3}}] * 4,
]}


@pytest.fixture(scope="module")
def farm2(tmp_path_factory: pytest.TempPathFactory, pg_server: Any) -> Iterator[Path]:
    """A detached farm of 2 supervisors (and 1 worker) on a fresh database; its home."""
    url = pg_server.new_database()
    home = tmp_path_factory.mktemp("farm2")
    write_home(home, SCRIPT, extra=f'[store]\nurl = "{url}"\nlease_s = 2\n')
    try:
        up = corral(home, "up", "--detach", "--supervisors", "2", "--workers", "1", "--json",
                    timeout_s=180)
        assert up.returncode == 0, up.stderr
        yield home
    finally:
        corral(home, "down")
        pg_server.drop_database(url)


def _info(home: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((home / "farm.json").read_text())
    return data


def _pid(home: Path, name: str) -> int:
    return next(int(c["pid"]) for c in _info(home)["children"] if c["name"] == name)


async def _turn(endpoint: str, ws: Path, *,
                placed: bool = False) -> tuple[str, list[dict[str, Any]]]:
    """A turn on a new session created at ``endpoint`` (``placed``: kept there, not
    placed by load)."""
    async with SupervisorClient(endpoint) as sv:
        sid = str(await sv.call("create_session", spec={"workspace": str(ws)},
                                placed=placed or None))
        sub = await sv.submit(sid, {"type": "user_input", "text": "go"})

        async def ended() -> list[dict[str, Any]] | None:
            events: list[dict[str, Any]] = (await sv.history(sid))["events"]
            done = any(e["type"] in ("turn_complete", "turn_aborted")
                       and e.get("submission_id") == sub for e in events)
            return events if done else None

        return sid, await eventually(ended, timeout_s=60, interval_s=0.1,
                                     what=f"the turn on {endpoint} to end")


async def test_two_supervisors_each_serve_turns_and_are_listed_and_restarted_alone(
        farm2: Path, workspace_root: Path) -> None:
    endpoints = _info(farm2)["endpoints"]["supervisors"]
    assert len(set(endpoints)) == 2, endpoints
    status = corral(farm2, "status")
    assert status.returncode == 0, status.stderr
    for n, ep in enumerate(endpoints, start=1):
        assert f"supervisor {n} endpoint {ep}" in status.stdout, status.stdout
    # A turn with a sandboxed tool call on each supervisor at once: with one broker
    # identity between them the broker treats each as the other's restart and drops
    # its calls, and the turns do not complete.
    (_, ev1), (_, ev2) = await asyncio.gather(
        _turn(endpoints[0], make_ws(workspace_root, "a")),
        _turn(endpoints[1], make_ws(workspace_root, "b")))
    for events in (ev1, ev2):
        assert [e["type"] for e in events if e["type"].startswith("turn_")][-1] \
            == "turn_complete", events
        ends = [e for e in events if e["type"] == "tool_call_end"]
        assert ends, events
        assert all(e["payload"]["outcome"] == "ok" for e in ends), ends
    async with SupervisorClient(endpoints[0]) as sv:
        owners = (await sv.status())["supervisors"]["owners"]
    assert len({o["id"] for o in owners}) == 2, owners
    assert all(o["sessions"] >= 1 for o in owners), owners
    # Each supervisor is its own child of the tree: a SIGKILL restarts that one alone.
    one, two = _pid(farm2, "supervisor"), _pid(farm2, "supervisor-2")
    os.kill(two, signal.SIGKILL)

    async def restarted() -> bool:
        child = next(c for c in _info(farm2)["children"] if c["name"] == "supervisor-2")
        return child["pid"] != two and child["state"] == "running"

    await eventually(restarted, timeout_s=60, interval_s=0.1, what="supervisor-2 restarted")
    assert _pid(farm2, "supervisor") == one


async def test_the_cli_reaches_a_session_owned_by_the_other_supervisor(
        farm2: Path, workspace_root: Path) -> None:
    """The CLI talks to supervisor 1; the session is owned by supervisor 2: supervisor 1
    answers ``moved`` with supervisor 2's address and the client follows it."""
    endpoints = _info(farm2)["endpoints"]["supervisors"]
    sid, first = await _turn(endpoints[1], make_ws(workspace_root, "c"), placed=True)
    async with SupervisorClient(endpoints[0], follow_redirects=False) as raw:
        with pytest.raises(SupervisorError) as moved:
            await raw.describe(sid)
    assert (moved.value.kind, moved.value.address) == ("moved", endpoints[1]), moved.value
    run = await asyncio.to_thread(corral, farm2, "run", "--json", "--session", sid, "again")
    assert run.returncode == 0, run.stderr + run.stdout
    later = events_of(run.stdout)
    assert later[-1]["type"] == "turn_complete", later
    last = max(e["sequence"] for e in first)
    durable = [e["sequence"] for e in later if e["sequence"] > 0]
    assert durable == list(range(last + 1, last + 1 + len(durable))), durable
    show = await asyncio.to_thread(corral, farm2, "show", "--json", sid)
    assert show.returncode == 0, show.stderr
    shown = [e["sequence"] for e in json.loads(show.stdout)["events"]]
    assert shown == list(range(1, durable[-1] + 1))
    async with SupervisorClient(endpoints[1], follow_redirects=False) as owner:
        await owner.describe(sid)  # still owned by supervisor 2: no redirect there


async def test_new_sessions_go_to_the_least_loaded_supervisor(
        farm2: Path, workspace_root: Path) -> None:
    endpoints = _info(farm2)["endpoints"]["supervisors"]
    ws = iter(make_ws(workspace_root, f"p{i}") for i in range(8))
    async with SupervisorClient(endpoints[0]) as one, \
            SupervisorClient(endpoints[1], follow_redirects=False) as raw2:
        ids = [(await one.status())["supervisors"]["self"],
               (await raw2.status())["supervisors"]["self"]]

        async def loads() -> list[int]:
            owners = {o["id"]: o["sessions"] for o in
                      (await one.status())["supervisors"]["owners"]}
            return [owners.get(i, 0) for i in ids]

        while (now := await loads())[1] - now[0] < 2:  # tilt the load towards 2
            await raw2.call("create_session", spec={"workspace": str(next(ws))}, placed=True)
        with pytest.raises(SupervisorError) as moved:  # 2 is busier: sent to 1
            await raw2.create_session(workspace=str(next(ws)))
        assert (moved.value.kind, moved.value.address) == ("moved", endpoints[0])
        before = await loads()
        async with SupervisorClient(endpoints[1]) as two:  # follows the placement
            sid = await two.create_session(workspace=str(next(ws)))
        assert await loads() == [before[0] + 1, before[1]]
        await one.describe(sid)
        while (now := await loads())[1] - now[0] > 0:  # 1 takes new sessions until even
            async with SupervisorClient(endpoints[1]) as two:
                await two.create_session(workspace=str(next(ws)))
        async with SupervisorClient(endpoints[0], follow_redirects=False) as raw1:
            await raw1.create_session(workspace=str(next(ws)))  # tie: stays where asked
        assert await loads() == [now[0] + 1, now[1]]


async def test_a_session_terminated_on_the_other_supervisor_is_deleted_through_the_first(
        farm2: Path, workspace_root: Path) -> None:
    """The CLI talks to supervisor 1; the session lives on supervisor 2. ``corral
    terminate`` is redirected there; the closed session's lease is then released (not
    kept, and counted as supervisor 2's load, for as long as it lives), so ``corral
    delete`` through supervisor 1 takes it and deletes it. Both once failed: the lease
    stayed supervisor 2's and the delete was refused ("holds no lease on it")."""
    endpoints = _info(farm2)["endpoints"]["supervisors"]
    sid, _ = await _turn(endpoints[1], make_ws(workspace_root, "t"), placed=True)
    term = await asyncio.to_thread(corral, farm2, "terminate", sid)
    assert term.returncode == 0, term.stderr + term.stdout

    async def released() -> bool:
        listed = await asyncio.to_thread(corral, farm2, "sessions", "--json")
        rows = [s for s in json.loads(listed.stdout)["sessions"] if s["session_id"] == sid]
        return rows[0]["owner"] is None

    await eventually(released, timeout_s=30, interval_s=0.1,
                     what="the closed session's lease to be released")
    delete = await asyncio.to_thread(corral, farm2, "delete", "--yes", sid)
    assert delete.returncode == 0, delete.stderr + delete.stdout
    listed = await asyncio.to_thread(corral, farm2, "sessions", "--json")
    assert sid not in listed.stdout
    # An active session of supervisor 2 is terminated and deleted in one command.
    sid2, _ = await _turn(endpoints[1], make_ws(workspace_root, "t2"), placed=True)
    delete = await asyncio.to_thread(corral, farm2, "delete", "--yes", sid2)
    assert delete.returncode == 0, delete.stderr + delete.stdout
    listed = await asyncio.to_thread(corral, farm2, "sessions", "--json")
    assert sid2 not in listed.stdout


async def test_status_and_run_go_on_through_supervisor_2_while_supervisor_1_is_stopped(
        farm2: Path, workspace_root: Path) -> None:
    """SIGSTOP supervisor 1 (the CLI's first choice): ``corral status`` (text and JSON)
    and ``corral run`` are served by supervisor 2 (they once waited 15 s and failed:
    "no answer from the supervisor ... is the farm up?"), and status lists supervisor 1,
    holding no session any more, as silent (a supervisor without live leases was not
    listed at all)."""
    endpoints = _info(farm2)["endpoints"]["supervisors"]
    async with SupervisorClient(endpoints[0]) as one, SupervisorClient(endpoints[1]) as two:
        id1 = (await one.status())["supervisors"]["self"]
        id2 = (await two.status())["supervisors"]["self"]
    stopped = _pid(farm2, "supervisor")
    os.kill(stopped, signal.SIGSTOP)
    try:
        async def silent() -> dict[str, Any] | None:
            st = await asyncio.to_thread(corral, farm2, "status", "--json")
            assert st.returncode == 0, st.stderr
            sups = json.loads(st.stdout)["supervisor"]["supervisors"]
            owners = {o["id"]: o for o in sups["owners"]}
            one = owners.get(id1)
            return sups if one and one["silent"] and one["sessions"] == 0 else None

        sups = await eventually(silent, timeout_s=60, interval_s=0.5,
                                what="supervisor 1 to be listed silent, holding nothing")
        assert sups["self"] == id2, sups
        assert {o["id"] for o in sups["owners"]} >= {id1, id2}, sups
        text = await asyncio.to_thread(corral, farm2, "status")
        assert text.returncode == 0, text.stderr
        assert f"{id1} at {endpoints[0]}: 0 sessions; SILENT: not heard for" in text.stdout, \
            text.stdout
        assert f"{id2} (this one)" in text.stdout, text.stdout
        assert "asking supervisor 2" in text.stderr, text.stderr
        run = await asyncio.to_thread(corral, farm2, "run", "--json", "--workspace",
                                      str(make_ws(workspace_root, "stopped1")), "go")
        assert run.returncode == 0, run.stderr + run.stdout
        assert events_of(run.stdout)[-1]["type"] == "turn_complete"
    finally:
        os.kill(stopped, signal.SIGCONT)


async def test_import_into_the_running_postgresql_farm(
        farm2: Path, workspace_root: Path, tmp_path: Path) -> None:
    """On a shared store the farm need not stop for ``corral import`` (it once refused:
    "stop the farm first ... the supervisor is the store's only writer", which on
    PostgreSQL is not so, and a farm of several hosts cannot be stopped for it): the new
    session is claimed by one of the supervisors, and the next ``corral run`` goes on."""
    endpoints = _info(farm2)["endpoints"]["supervisors"]
    sid, _ = await _turn(endpoints[0], make_ws(workspace_root, "exp"))
    out = tmp_path / "cp.json"
    exp = await asyncio.to_thread(corral, farm2, "export", sid, "--out", str(out))
    assert exp.returncode == 0, exp.stderr
    new_id = "sess_imported_into_running_pg"
    imp = await asyncio.to_thread(corral, farm2, "import", str(out), "--session", new_id,
                                  "--workspace", str(make_ws(workspace_root, "imp")))
    assert imp.returncode == 0, imp.stderr + imp.stdout
    run = await asyncio.to_thread(corral, farm2, "run", "--json", "--session", new_id,
                                  "go on")
    assert run.returncode == 0, run.stderr + run.stdout
    assert events_of(run.stdout)[-1]["type"] == "turn_complete"


async def test_a_second_process_of_a_live_supervisor_id_is_refused(
        farm2: Path, tmp_path: Path) -> None:
    """``python -m supervisor --home HOME`` on the farm's own host and home (a user adding
    a supervisor "like the docs say") has supervisor 1's default id: it exits 2 saying
    so, before claiming anything. It once started: took supervisor 1's sessions (a start
    claims those of its own id) and its advertised address, so clients asking for them
    were sent to it."""
    endpoints = _info(farm2)["endpoints"]["supervisors"]
    async with SupervisorClient(endpoints[0]) as one:
        own_id = (await one.status())["supervisors"]["self"]
    front = json.loads((farm2 / "farm.json").read_text())["endpoints"]["broker_frontend"]
    try:
        dup = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "supervisor", "--home", str(farm2),
                             "--listen", f"ipc://{tmp_path}/dup.sock", "--broker", front],
            capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired as exc:  # it ran: the bug
        raise AssertionError(f"a second supervisor of id {own_id} kept running") from exc
    assert dup.returncode == 2, dup.stderr[-2000:]
    assert f"supervisor id {own_id!r} is in use by pid {_pid(farm2, 'supervisor')}" \
        in dup.stderr, dup.stderr[-2000:]
    async with SupervisorClient(endpoints[1]) as two:
        owners = {o["id"]: o for o in (await two.status())["supervisors"]["owners"]}
    assert owners[own_id]["address"] == endpoints[0], owners


async def test_a_session_taken_over_uses_the_inline_route_its_owner_registered(
        farm2: Path, workspace_root: Path, tmp_path: Path, procs: Procs) -> None:
    """An inline route (``corral run --model script:PATH``: a new provider URL each run)
    registered on supervisor 2 is the one supervisor 1 uses when it takes the session
    over mid-turn; it once kept its own older copy of the route (an earlier run's URL,
    that provider gone) and the taken-over turn failed ``connect_error``."""
    endpoints = _info(farm2)["endpoints"]["supervisors"]
    script = tmp_path / "slow.json"
    script.write_text(json.dumps({"responses": [
        {"tool_calls": [{"name": "shell", "arguments": {"command": "sleep 3; echo slept"}}]},
        {"text": "done after the takeover", "usage": {"input": 10, "output": 3}}]}))
    route = {"name": f"script:{script}", "provider": "openai-responses", "model": "scripted",
             "script": str(script), "native_compaction": True}

    def provider() -> tuple[subprocess.Popen[bytes], str]:
        proc = procs.python("sandbox_worker.fakellm", "--script", str(script), "--port", "0",
                            stdout=subprocess.PIPE)
        return proc, str(read_ready(proc, 30.0)["url"])

    old, old_url = provider()  # an earlier run, through supervisor 1
    async with SupervisorClient(endpoints[0], follow_redirects=False) as one:
        await one.call("create_session", placed=True, spec={
            "workspace": str(make_ws(workspace_root, "r1")),
            "route_spec": {**route, "base_url": old_url}})
    old.kill()
    old.wait(10)
    _, url = provider()  # this run, through supervisor 2
    async with SupervisorClient(endpoints[1], follow_redirects=False) as two:
        sid = str(await two.call("create_session", placed=True, spec={
            "workspace": str(make_ws(workspace_root, "r2")),
            "route_spec": {**route, "base_url": url}}))
        await two.submit(sid, {"type": "user_input", "text": "go"})

        async def tool_started() -> bool:
            return any(e["type"] == "tool_call_begin"
                       for e in (await two.history(sid))["events"])

        await eventually(tool_started, timeout_s=30, what="the tool call on supervisor 2")
    stopped = _pid(farm2, "supervisor-2")
    os.kill(stopped, signal.SIGSTOP)
    try:
        async with SupervisorClient(endpoints[0]) as one:
            async def ended() -> list[dict[str, Any]] | None:
                events: list[dict[str, Any]] = (await one.history(sid))["events"]
                done = any(e["type"] in ("turn_complete", "turn_aborted") for e in events)
                return events if done else None

            events = await eventually(ended, timeout_s=120, interval_s=0.2,
                                      what="the turn to end on supervisor 1")
    finally:
        os.kill(stopped, signal.SIGCONT)
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "turn_complete", [e for e in events if e["type"] == "error"]
    ends = [e["payload"]["outcome"] for e in events if e["type"] == "tool_call_end"]
    assert ends == ["unknown"], ends  # taken over mid-call: reported, not re-run


async def test_terminate_and_delete_from_a_home_without_a_farm_go_through_the_owner(
        farm2: Path, workspace_root: Path, tmp_path: Path) -> None:
    """Another home with the farm's corral.toml and no farm of its own (an operator's
    host): ``corral terminate`` of a session a supervisor runs goes through that
    supervisor (it once said "no session ... in HOME": it looked for a SQLite file
    first), and so does ``corral delete`` of an active one (it once pulled the rows from
    under the running owner)."""
    endpoints = _info(farm2)["endpoints"]["supervisors"]
    other = tmp_path / "operator"
    other.mkdir()
    (other / "corral.toml").write_text((farm2 / "corral.toml").read_text())
    sid, _ = await _turn(endpoints[1], make_ws(workspace_root, "o1"), placed=True)
    term = await asyncio.to_thread(corral, other, "terminate", sid)
    assert term.returncode == 0, term.stderr + term.stdout
    assert f"session {sid} terminated" in term.stdout
    async with SupervisorClient(endpoints[1]) as two:
        assert (await two.describe(sid))["status"] == "closed"
    sid2, _ = await _turn(endpoints[1], make_ws(workspace_root, "o2"), placed=True)
    delete = await asyncio.to_thread(corral, other, "delete", "--yes", sid2)
    assert delete.returncode == 0, delete.stderr + delete.stdout
    listed = await asyncio.to_thread(corral, farm2, "sessions", "--json")
    assert sid2 not in listed.stdout
    log = (farm2 / "logs" / "supervisor-2.log").read_text()
    assert f"session {sid2}: lease lost" not in log


def test_down_stops_each_supervisor_on_its_term_signal(farm2: Path) -> None:
    """The module's last use of the farm. Each supervisor ends on SIGTERM: none is
    left to the farm's stop timeout and SIGKILL (a lease keeper once kept a
    PostgreSQL supervisor's task group open: 10 s per supervisor)."""
    pids = [_pid(farm2, "supervisor"), _pid(farm2, "supervisor-2")]
    down = corral(farm2, "down")
    assert down.returncode == 0, down.stderr
    log = (farm2 / "logs" / "farm.log").read_text()
    assert "did not stop within" not in log, log[-2000:]
    assert not [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_several_supervisors_without_a_store_url_are_a_config_error(tmp_path: Path) -> None:
    write_home(tmp_path, SCRIPT)
    up = corral(tmp_path, "up", "--detach", "--supervisors", "2")
    assert up.returncode == 2, (up.stdout, up.stderr)
    assert "[farm.supervisors]" in up.stderr, up.stderr
    assert "[store]" in up.stderr, up.stderr
    assert not (tmp_path / "farm.json").exists()
    (tmp_path / "corral.toml").write_text((tmp_path / "corral.toml").read_text()
                                          + "[farm]\nsupervisors = 3\n")
    up = corral(tmp_path, "up", "--detach")
    assert up.returncode == 2, up.stderr
    assert "postgresql://" in up.stderr, up.stderr
