"""MCP servers through real processes: the broker, two sandbox workers, the
servers in the sandbox; calls sent as the engine sends them
(``calls.call_tool``), so the router's validation and affinity are real."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

from broker.client import BrokerClient
from sandbox_worker.api import McpCall, ToolCallRequest, ToolCallResult
from supervisor.engine.calls import call_tool
from supervisor.engine.errors import CallFailed
from supervisor.tools.router import router_for
from tests.engine.farm import Farm, new_workspace
from tests.helpers import PYTHON, Procs, eventually, read_line_with_deadline
from tests.tools.conftest import HERE, server_spec

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(300)]

# An HTTP server's credential, in the environment the farm's workers inherit
# (set before this module's farm starts).
TOKEN = "corral-test-" + uuid.uuid4().hex
os.environ["CORRAL_MCP_TEST_TOKEN"] = TOKEN


def request(ws: str, sid: str, server: str, spec: dict[str, Any], tool: str,
            arguments: dict[str, Any] | None = None) -> ToolCallRequest:
    req = ToolCallRequest(call_id=f"c-{uuid.uuid4().hex[:8]}", tool=f"mcp__{server}__{tool}",
                          arguments=arguments or {}, session_id=sid, workspace=ws)
    req["mcp"] = McpCall(server=server, spec=spec, op="call", tool=tool)  # type: ignore[typeddict-item]
    return req


async def call(client: BrokerClient, req: ToolCallRequest, budget_s: float = 60.0
               ) -> ToolCallResult:
    return await call_tool(client, req, budget_s=budget_s)


async def test_published_servers_run_sandboxed(tools_farm: Farm, sandbox_site: str) -> None:
    ws = new_workspace()
    subprocess.run(["git", "init", "-q", str(ws)], check=True)  # noqa: ASYNC221
    (ws / "a.txt").write_text("hello\n")
    sid = "sess-published"
    time_spec = server_spec(sandbox_site, "mcp_server_time", "--local-timezone", "UTC")
    git_spec = server_spec(sandbox_site, "mcp_server_git")
    async with BrokerClient(tools_farm.frontend) as client:
        got = await call(client, request(str(ws), sid, "time", time_spec, "get_current_time",
                                         {"timezone": "Europe/Paris"}))
        assert not got["is_error"], got["output"]
        assert "Europe/Paris" in got["output"]
        iso = got["isolation"]
        assert (iso["tier"], iso["network"]) == ("T2", "none")
        assert iso["uid"] > 0
        assert iso["kernel"] is not None
        assert iso["kernel"]["uids"][0] == iso["uid"]
        got = await call(client, request(str(ws), sid, "git", git_spec, "git_status",
                                         {"repo_path": "/workspace"}))
        assert not got["is_error"], got["output"]
        assert "a.txt" in got["output"]
        listed = router_for(client).listed(sid, "git")
        assert listed is not None
        assert "mcp__git__git_status" in listed.schemas
        assert listed.schemas["mcp__git__git_status"]["parameters"]["type"] == "object"


def own(site: str, mode: str = "ok") -> dict[str, Any]:
    return server_spec(site, "corral_test_mcp_server", mode)


def uid_processes(uid: int) -> list[int]:
    return [p.pid for p in psutil.process_iter(["uids"])
            if p.info["uids"] is not None and p.info["uids"].real == uid]


async def test_own_server_state_limits_and_restarts(tools_farm: Farm, sandbox_site: str
                                                    ) -> None:
    ws = str(new_workspace())
    sid = "sess-own"
    spec = own(sandbox_site)

    def req(tool: str, **arguments: Any) -> ToolCallRequest:
        return request(ws, sid, "t", spec, tool, arguments)

    async with BrokerClient(tools_farm.frontend) as client:
        first = await call(client, req("add", n=2))
        assert first["output"] == "2", first["output"]
        pin = first.get("pin")
        assert pin is not None
        assert pin.startswith("tool@")
        second = await call(client, req("add", n=3))
        assert (second["output"], second.get("pin")) == ("5", pin)  # state, same worker
        who = await call(client, req("whoami"))
        assert f"uid={who['isolation']['uid']} cwd=/workspace" in who["output"]
        assert router_for(client).listed(sid, "t").schemas["mcp__t__whoami"]["read_only"]

        # Invalid arguments never leave the supervisor: no worker answered (no pin).
        bad = await call(client, req("add", n="two"))
        assert bad["error_kind"] == "bad_arguments"
        assert "n" in bad["output"]
        assert "pin" not in bad

        # A call past its budget is cancelled; the server answers a ping, so it
        # lives on with its state.
        late = await call(client, req("sleep", seconds=60), budget_s=4.0)
        assert late["error_kind"] == "timeout", late["output"]
        assert late["duration_s"] < 4.0
        again = await call(client, req("add", n=1))
        assert again["output"] == "6", again["output"]

        # 50 MB in one message: a typed error, the server stopped, the worker up.
        uid = who["isolation"]["uid"]
        huge = await call(client, req("big", n_bytes=50_000_000))
        assert huge["error_kind"] == "output_limit", huge["output"]
        assert uid_processes(uid) == []  # its whole tree is gone
        restarted = await call(client, req("add", n=1))
        assert restarted["output"] == "1"  # started again: fresh state

        # A hung server (no answer to the call, none to the ping) is killed.
        uid = restarted["isolation"]["uid"]
        hung = await call(client, req("hang"), budget_s=4.0)
        assert hung["error_kind"] == "timeout"
        await eventually(lambda: _none(uid), timeout_s=10, what="the hung server killed")
        assert (await call(client, req("add", n=4)))["output"] == "4"

        # Restart intensity: 3 restarts in 60 s, then calls are refused.
        kinds = [(await call(client, req("crash")))["error_kind"] for _ in range(2)]
        assert kinds == ["mcp_server_died", "mcp_server_died"]
        refused = await call(client, req("add", n=1))
        assert refused["error_kind"] == "mcp_restart_limit", refused["output"]


async def _none(uid: int) -> bool:
    return uid_processes(uid) == []


@pytest.mark.parametrize(("mode", "says"), [
    ("garbage", "not JSON-RPC"),
    ("fail", "error: the database is missing"),  # its stderr's last lines
    ("noinit", "did not answer initialize"),
])
async def test_broken_servers_get_typed_errors(tools_farm: Farm, sandbox_site: str, mode: str,
                                               says: str) -> None:
    ws = str(new_workspace())
    async with BrokerClient(tools_farm.frontend) as client:
        # A server that never answers is given up at its spec's start_timeout_s (the
        # default, 30 s, would be cut by this call's 20 s budget instead).
        spec = {**own(sandbox_site, mode), **({"start_timeout_s": 3.0} if mode == "noinit"
                                               else {})}
        started = time.monotonic()
        got = await call(client, request(ws, f"sess-{mode}", "b", spec, "add", {"n": 1}),
                         budget_s=20.0)
        assert got["error_kind"] == "mcp_start_failed"
        assert says in got["output"], got["output"]
        if mode == "noinit":
            assert "within 3 s" in got["output"], got["output"]
            assert time.monotonic() - started < 15.0
        # The worker is still up and serving.
        ok = await call(client, request(ws, f"sess-{mode}-ok", "t", own(sandbox_site),
                                        "add", {"n": 7}))
        assert ok["output"] == "7"


async def test_invalid_schema_is_not_offered(tools_farm: Farm, sandbox_site: str) -> None:
    ws = str(new_workspace())
    sid = "sess-badschema"
    async with BrokerClient(tools_farm.frontend) as client:
        got = await call(client, request(ws, sid, "s", own(sandbox_site, "badschema"), "big",
                                         {"n_bytes": 1}))
        assert got["error_kind"] == "invalid_schema", got["output"]
        listed = router_for(client).listed(sid, "s")
        assert listed is not None
        assert "mcp__s__big" in listed.broken
        assert "mcp__s__add" in listed.schemas
        ok = await call(client, request(ws, sid, "s", own(sandbox_site, "badschema"), "add",
                                        {"n": 2}))
        assert ok["output"] == "2"


async def test_worker_loss_then_restart_elsewhere(tools_farm: Farm, sandbox_site: str) -> None:
    ws = str(new_workspace())
    sid = "sess-loss"
    spec = own(sandbox_site)
    async with BrokerClient(tools_farm.frontend) as client:
        first = await call(client, request(ws, sid, "t", spec, "add", {"n": 5}))
        pin = first["pin"]
        holder = next(w for w in tools_farm.workers if w.poll() is None
                      and _serves(w.pid, first["isolation"]["uid"]))
        slow = asyncio.ensure_future(call(client, request(ws, sid, "t", spec, "sleep",
                                                          {"seconds": 60})))
        await eventually(lambda: _sleeping(ws), timeout_s=20,
                         what="the sleep call reached the server")
        holder.kill()
        with pytest.raises(CallFailed) as lost:
            await slow
        assert lost.value.worker_lost
        tools_farm.add_worker()  # the farm keeps two workers for the next tests
        # The next call finds the pin gone (unroutable) and starts the server
        # again on another worker: its state is new.
        again = await call(client, request(ws, sid, "t", spec, "add", {"n": 1}))
        assert again["output"] == "1", again["output"]
        assert again["pin"] != pin


def _serves(worker_pid: int, uid: int) -> bool:
    try:
        kids = psutil.Process(worker_pid).children(recursive=True)
    except psutil.Error:
        return False
    return any(k.uids().real == uid for k in kids if k.is_running())


async def _sleeping(ws: str) -> bool:
    # The test server's sleep tool leaves ``sleeping`` in its cwd (the
    # workspace) before it sleeps: the call reached the server.
    return await asyncio.to_thread(os.path.exists, os.path.join(ws, "sleeping"))


async def test_interrupts_reach_the_server(tools_farm: Farm, sandbox_site: str) -> None:
    """A cancelled call (an interrupt: CANCEL through the broker) sends
    notifications/cancelled; a server that still answers keeps its state, a
    hung one is killed, tree and all."""
    ws = str(new_workspace())
    sid = "sess-cancel"
    spec = own(sandbox_site)

    def req(tool: str, **arguments: Any) -> ToolCallRequest:
        return request(ws, sid, "t", spec, tool, arguments)

    async with BrokerClient(tools_farm.frontend) as client:
        first = await call(client, req("add", n=10))
        uid = first["isolation"]["uid"]
        with pytest.raises(TimeoutError):  # the caller gives up: its task is cancelled
            await asyncio.wait_for(call(client, req("sleep", seconds=60)), timeout=8.0)
        counted = await eventually(lambda: _cancelled(client, req), timeout_s=10,
                                   what="the server saw notifications/cancelled")
        assert counted == "1"
        assert (await call(client, req("add", n=1)))["output"] == "11"  # same server
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(call(client, req("hang")), timeout=8.0)
        await eventually(lambda: _none(uid), timeout_s=15, what="the hung server killed")
        assert (await call(client, req("add", n=1)))["output"] == "1"  # a new server


async def _cancelled(client: BrokerClient, req: Any) -> str | None:
    got = await call(client, req("cancelled"))
    return got["output"] if got["output"] != "0" else None


async def test_http_server_called_from_the_worker(tools_farm: Farm, procs: Procs) -> None:
    proc = procs.spawn([PYTHON, str(HERE / "corral_test_mcp_server.py"), "http"],
                       name="mcp-http", stdout=subprocess.PIPE)
    port = json.loads(read_line_with_deadline(proc, 60))["port"]
    url = f"http://127.0.0.1:{port}/mcp"
    ws = str(new_workspace())
    spec = {"url": url, "headers_env": {"X-Corral-Token": "CORRAL_MCP_TEST_TOKEN"}}
    async with BrokerClient(tools_farm.frontend) as client:
        got = await call(client, request(ws, "sess-http", "h", spec, "token"))
        assert got["output"] == str(len(TOKEN)), got["output"]
        iso = got["isolation"]
        assert (iso["filesystem"], iso["tier"]) == ("remote", "T0")
        assert iso["degraded"]
        assert TOKEN not in json.dumps(got)
        # A server that echoes the header, in a result or an error: the value
        # reaches no result (the transcript, checkpoints and exports hold these).
        echoed = await call(client, request(ws, "sess-http", "h", spec, "echo_token"))
        assert echoed["output"] == "you sent [REDACTED]", echoed["output"]
        failed = await call(client, request(ws, "sess-http", "h", spec, "fail_token"))
        assert failed["is_error"], failed
        assert "bad token [REDACTED]" in failed["output"], failed["output"]
        for out in (echoed, failed):
            assert TOKEN not in json.dumps(out)
        missing = {"url": url, "headers_env": {"X-Corral-Token": "CORRAL_MCP_UNSET_VAR"}}
        refused = await call(client, request(ws, "sess-http2", "h", missing, "token"))
        assert refused["error_kind"] == "mcp_start_failed"
        assert "CORRAL_MCP_UNSET_VAR" in refused["output"]
    for log in (tools_farm.tmp / "logs").glob("*.log"):
        assert TOKEN not in log.read_text(errors="replace"), log


async def test_http_server_killed_mid_call(tools_farm: Farm, procs: Procs,
                                           tmp_path: Path) -> None:
    """A streamable-HTTP server SIGKILLed while it runs a call: the call gets
    a typed error long before its budget, the next call to the dead URL fails
    fast, and the worker serves a new server at once (nothing wedged)."""
    def spawn(name: str) -> subprocess.Popen[bytes]:
        (tmp_path / name).mkdir()
        return procs.spawn([PYTHON, str(HERE / "corral_test_mcp_server.py"), "http"],
                           name="mcp-http", stdout=subprocess.PIPE, cwd=tmp_path / name)

    def spec_of(proc: subprocess.Popen[bytes]) -> dict[str, Any]:
        port = json.loads(read_line_with_deadline(proc, 60))["port"]
        return {"url": f"http://127.0.0.1:{port}/mcp",
                "headers_env": {"X-Corral-Token": "CORRAL_MCP_TEST_TOKEN"}}

    proc, second = spawn("one"), spawn("two")  # both start at once
    spec = spec_of(proc)
    ws = str(new_workspace())
    budget_s = 60.0
    async with BrokerClient(tools_farm.frontend) as client:
        assert (await call(client, request(ws, "sess-httpkill", "h", spec, "add",
                                           {"n": 2})))["output"] == "2"
        started = time.monotonic()
        slow = asyncio.ensure_future(call(client, request(ws, "sess-httpkill", "h", spec,
                                                          "sleep", {"seconds": 600}),
                                          budget_s=budget_s))
        await eventually(lambda: _sleeping(str(tmp_path / "one")), timeout_s=30,
                         what="the sleep call reached the HTTP server")
        proc.kill()
        got = await asyncio.wait_for(slow, timeout=budget_s)
        took = time.monotonic() - started
        assert got["is_error"], got
        assert got["error_kind"] == "mcp_server_died", got
        assert took < budget_s / 2, f"the dropped call took {took:.1f} s"
        again = await asyncio.wait_for(call(client, request(ws, "sess-httpkill", "h", spec,
                                                            "add", {"n": 1})), timeout=40)
        assert again["is_error"], again
        assert again["error_kind"] == "mcp_start_failed", again
        other = spec_of(second)
        fresh = await asyncio.wait_for(call(client, request(ws, "sess-httpkill", "h", other,
                                                            "add", {"n": 7})), timeout=40)
        assert fresh["output"] == "7", fresh


async def test_idle_server_stops_without_further_requests(procs: Procs, tmp_path: Path,
                                                          sandbox_site: str) -> None:
    """A session's server that nobody calls again (its session ended) is stopped
    once idle, even when no other MCP request reaches its worker: the idle check
    ran only at MCP requests, so such a server, its uid and its workspace pin
    lived on for as long as the worker did."""
    from tests.engine.farm import start_farm

    farm = start_farm(procs, tmp_path, {"responses": [{"text": "ok"}]}, workers=0)
    farm.add_worker("tool", 4, extra=["--mcp-idle-s", "1"])
    ws = str(new_workspace())
    async with BrokerClient(farm.frontend) as client:
        first = await call(client, request(ws, "sess-idle", "t", own(sandbox_site), "add",
                                           {"n": 2}))
        assert first["output"] == "2", first["output"]
        uid = first["isolation"]["uid"]
        assert uid_processes(uid), "the server runs"
        # No MCP request comes again: the server is stopped all the same.
        await eventually(lambda: _none(uid), timeout_s=20,
                         what="the idle server stopped without another request")


async def test_notification_flood_does_not_flood_the_worker_log(
        procs: Procs, tmp_path: Path, sandbox_site: str) -> None:
    """A server that writes 20,000 notifications the client cannot validate
    before answering: the call answers, and the worker's log holds a bounded
    number of lines about them (the SDK logged each one, traceback and all)."""
    from tests.engine.farm import start_farm

    farm = start_farm(procs, tmp_path, {"responses": [{"text": "ok"}]}, workers=0)
    worker = farm.add_worker("tool", 4)
    ws = str(new_workspace())
    async with BrokerClient(farm.frontend) as client:
        got = await call(client, request(ws, "sess-flood", "t", own(sandbox_site), "flood",
                                         {"n": 20_000}))
        assert got["output"] == "flooded", got["output"]
        again = await call(client, request(ws, "sess-flood", "t", own(sandbox_site), "add",
                                           {"n": 1}))
        assert again["output"] == "1", again["output"]
    log = procs.log(worker)
    said = log.count("Failed to validate notification")
    assert 0 < said <= 20, (said, len(log))
    assert len(log) < 200_000, len(log)


@pytest.mark.parametrize("tier", ["T2", "T1"])
async def test_a_server_daemon_dies_with_its_worker(procs: Procs, tmp_path: Path,
                                                     sandbox_site: str, tier: str) -> None:
    """A server that leaves a double-forked daemon (its own session, SIGTERM and
    SIGHUP ignored), then its worker SIGKILLed: nothing of the server's uid is
    left (T2: the pid namespace; T1: the launcher's parent-death signal)."""
    from tests.engine.farm import start_farm

    farm = start_farm(procs, tmp_path, {"responses": [{"text": "ok"}]}, workers=0)
    worker = farm.add_worker("tool", 4, extra=["--force-tier", tier, "--tier-min", "T1"])
    ws = str(new_workspace())
    async with BrokerClient(farm.frontend) as client:
        got = await call(client, request(ws, "sess-daemon", "t", own(sandbox_site), "daemon"))
        assert got["output"].startswith("daemon left by"), got["output"]
        assert got["isolation"]["tier"] == tier
        uid = got["isolation"]["uid"]
        await eventually(lambda: _more_than(uid, 1), timeout_s=10,
                         what="the server and its daemon run")
    worker.kill()
    worker.wait(timeout=10)
    await eventually(lambda: _none(uid), timeout_s=10,
                     what="nothing of the server's uid left after its worker's SIGKILL")


async def _more_than(uid: int, n: int) -> bool:
    return len(uid_processes(uid)) > n
