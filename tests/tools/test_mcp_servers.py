"""MCP servers through real processes: the broker, two sandbox workers, the
servers in the sandbox; calls sent as the engine sends them
(``calls.call_tool``), so the router's validation and affinity are real."""

from __future__ import annotations

import subprocess
import uuid
from typing import Any

import pytest

from broker.client import BrokerClient
from sandbox_worker.api import McpCall, ToolCallRequest, ToolCallResult
from supervisor.engine.calls import call_tool
from supervisor.tools.router import router_for
from tests.engine.farm import Farm, new_workspace
from tests.tools.conftest import server_spec

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(300)]


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
