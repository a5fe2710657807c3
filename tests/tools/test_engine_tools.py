"""Outside tools through the engine: a SessionManager with a scripted model
calls an MCP server's tools and a command tool; the offered schemas, approval
globs, events, isolation records and worker-loss flags are the engine's own."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from sandbox_worker.api import ModelRoute
from supervisor.engine.tooling import idempotent_in
from supervisor.store.records import EventRecord
from tests.engine.farm import Farm, _ready, engine, new_workspace, write_script
from tests.helpers import PYTHON, Procs, eventually
from tests.tools.conftest import server_spec
from tests.tools.test_command_tools import DOUBLE
from tests.tools.test_mcp_servers import _serves

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(240)]

SCRIPT = {"responses": [
    {"tool_calls": [{"name": "mcp__t__add", "arguments": {"n": 2}},
                    {"name": "double", "arguments": {"x": 4}},
                    {"name": "mcp__g__whoami", "arguments": {}}]},
    {"tool_calls": [{"name": "mcp__t__add", "arguments": {"n": 3}}]},
    {"text": "done"},
]}


async def test_a_turn_uses_mcp_and_command_tools(tools_farm: Farm, sandbox_site: str,
                                                 procs: Procs) -> None:
    script = write_script(tools_farm.tmp, SCRIPT, "engine-script.json")
    llm = procs.spawn([PYTHON, "-m", "sandbox_worker.fakellm", "--script", str(script),
                       "--port", "0"], name="fakellm", stdout=subprocess.PIPE)
    url = _ready(llm)["url"]
    route = ModelRoute(name="main", provider="openai-responses", model="scripted",
                       base_url=url, max_retries=0)
    own = server_spec(sandbox_site, "corral_test_mcp_server")
    ws = new_workspace()
    async with engine(tools_farm, routes={"main": route}) as eng:
        sid = await eng.session(
            workspace=str(ws), mcp={"t": own, "g": own}, command_tools={"double": DOUBLE},
            approval={"default": "allow", "deny": ["mcp__g__*"]})
        events = await eng.run_until(sid, {"type": "user_input", "text": "go"},
                                     timeout_s=180)
        ends = {(e.payload["name"], e.payload["output"].split()[0] if e.payload["output"]
                 else ""): e.payload for e in events if e.type == "tool_call_end"}
        assert ("mcp__t__add", "2") in ends, list(ends)
        assert ("mcp__t__add", "5") in ends  # the server kept its state across steps
        assert ("double", "8") in ends
        added = ends[("mcp__t__add", "5")]
        assert added["isolation"]["tier"] == "T2"
        assert added["isolation"]["uid"] > 0
        denied = next(p for (name, _), p in ends.items() if name == "mcp__g__whoami")
        assert denied["outcome"] == "deny"
        assert "mcp__g__*" in denied["output"]
        assert events[-1].type == "turn_complete"
        session = eng.manager.sessions[sid]
        assert idempotent_in(session, "mcp__t__whoami")  # readOnlyHint
        assert not idempotent_in(session, "mcp__t__add")
        assert idempotent_in(session, "double")
    offered = {t["name"] for t in _first_request_tools(url)}
    assert {"shell", "double", "mcp__t__add", "mcp__t__whoami", "mcp__g__add"} <= offered


def _first_request_tools(url: str) -> list[dict[str, str]]:
    import json
    import urllib.request

    with urllib.request.urlopen(url.rstrip("/") + "/_corral/requests", timeout=10) as resp:
        requests = json.loads(resp.read())
    first = next(r for r in requests if r["path"].endswith("/responses"))
    return list(first["body"]["tools"])


LOSS_SCRIPT = {"responses": [
    {"tool_calls": [{"name": "mcp__t__add", "arguments": {"n": 5}}]},
    {"tool_calls": [{"name": "mcp__t__sleep", "arguments": {"seconds": 60}}]},
    {"tool_calls": [{"name": "mcp__t__add", "arguments": {"n": 1}}]},
    {"tool_calls": [{"name": "mcp__t__peek", "arguments": {"seconds": 60}}]},
    {"text": "done"},
]}


async def test_a_lost_worker_ends_the_mcp_call_unknown_and_the_server_moves(
        tools_farm: Farm, sandbox_site: str, procs: Procs) -> None:
    """The worker holding a session's server is SIGKILLed while a
    side-effecting MCP call runs: the call ends ``unknown`` / ``worker_lost``
    in the session's events, context and execution record, is never re-run,
    and the next call starts the server on another worker (fresh state). Then
    the same while a tool the server declares read-only runs: that call is run
    again (attempt 2) on another worker and ends ``ok``."""
    script = write_script(tools_farm.tmp, LOSS_SCRIPT, "loss-script.json")
    llm = procs.spawn([PYTHON, "-m", "sandbox_worker.fakellm", "--script", str(script),
                       "--port", "0"], name="fakellm", stdout=subprocess.PIPE)
    route = ModelRoute(name="main", provider="openai-responses", model="scripted",
                       base_url=_ready(llm)["url"], max_retries=0)
    ws = new_workspace()

    def begun(name: str) -> Callable[[EventRecord], bool]:
        return lambda e: e.type == "tool_call_begin" and e.payload["name"] == name

    async def kill_holder(marker: str, uid: int) -> int:
        await eventually(lambda: _exists(ws / marker), timeout_s=30,
                         what=f"the call reached the server ({marker})")
        holder = next(w for w in tools_farm.workers if w.poll() is None
                      and _serves(w.pid, uid))
        holder.kill()
        tools_farm.add_worker()  # the module's farm keeps two workers
        return holder.pid

    async with engine(tools_farm, routes={"main": route}) as eng:
        sid = await eng.session(workspace=str(ws), approval="allow",
                                mcp={"t": server_spec(sandbox_site, "corral_test_mcp_server")})
        events = await eng.run_until(sid, {"type": "user_input", "text": "go"}, timeout_s=120,
                                     until=begun("mcp__t__sleep"))
        first = next(e.payload for e in events if e.type == "tool_call_end")
        assert first["output"] == "5", first
        await kill_holder("sleeping", first["isolation"]["uid"])
        more = await eng.run_until(sid, None, timeout_s=120, until=begun("mcp__t__peek"),
                                   after_sequence=events[-1].sequence)
        lost, again = [e.payload for e in more if e.type == "tool_call_end"]
        assert (lost["name"], lost["outcome"], lost["state"]) == (
            "mcp__t__sleep", "unknown", "unknown"), lost
        assert lost["error"]["kind"] == "worker_lost"
        assert again["output"] == "1", again  # a new server: its state starts over
        assert again["isolation"]["tier"] == "T2"
        await kill_holder("peeking", again["isolation"]["uid"])
        rest = await eng.run_until(sid, None, timeout_s=120,
                                   after_sequence=more[-1].sequence)
        peek = next(e.payload for e in rest if e.type == "tool_call_end")
        assert (peek["name"], peek["outcome"], peek["attempt"]) == ("mcp__t__peek", "ok", 2), peek
        assert peek["output"] == "peeked again"
        assert rest[-1].type == "turn_complete"
        begins = [e.payload["name"] for e in [*events, *more, *rest]
                  if e.type == "tool_call_begin"]
        assert begins.count("mcp__t__sleep") == 1  # never re-run
        saved = await eng.store.load(sid)
        assert saved is not None
        output = next(i["output"] for i in saved.context
                      if i.get("type") == "function_call_output"
                      and i["call_id"] == lost["call_id"])
        assert "unknown" in output
        execution = (await eng.store.executions_page(sid, limit=1)).items[0]
        assert (execution.tool_calls, execution.failed_tool_calls) == (4, 1)


async def _exists(path: Path) -> bool:
    return await asyncio.to_thread(path.exists)
