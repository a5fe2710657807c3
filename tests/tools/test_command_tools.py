"""Command tools through real processes: arguments as JSON on stdin in the
sandbox, stdout the result, a non-zero exit an error, bounded output, and
arguments checked against the declared schema before anything is sent."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from broker.client import BrokerClient
from sandbox_worker.api import CommandToolSpec, ToolCallRequest, ToolCallResult
from supervisor.engine.calls import call_tool
from supervisor.tools.specs import parse_command_tool
from tests.engine.farm import Farm, new_workspace

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(180)]

PY = "/usr/bin/python3"
DOUBLE = parse_command_tool("double", {
    "description": "Double x.",
    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}},
                   "required": ["x"], "additionalProperties": False},
    "command": [PY, "-c", "import json, os, sys; a = json.load(sys.stdin); "
                "print(a['x'] * 2, os.getuid(), os.getcwd())"],
    "idempotent": True})


def tool(name: str, command: list[str], **extra: Any) -> CommandToolSpec:
    return parse_command_tool(name, {"description": name, "command": command, **extra})


async def run(client: BrokerClient, ws: str, name: str, spec: CommandToolSpec,
              arguments: dict[str, Any], budget_s: float = 30.0) -> ToolCallResult:
    req = ToolCallRequest(call_id=f"c-{uuid.uuid4().hex[:8]}", tool=name, arguments=arguments,
                          session_id="sess-cmd", workspace=ws)
    req["command_tool"] = spec
    return await call_tool(client, req, budget_s=budget_s)


async def test_command_tools(tools_farm: Farm) -> None:
    ws = str(new_workspace())
    async with BrokerClient(tools_farm.frontend) as client:
        got = await run(client, ws, "double", DOUBLE, {"x": 21})
        assert not got["is_error"], got["output"]
        value, uid, cwd = got["output"].split()
        iso = got["isolation"]
        assert (value, int(uid), cwd) == ("42", iso["uid"], "/workspace")
        assert iso["tier"] == "T2"
        assert iso["kernel"] is not None
        assert got["tool"] == "double"

        # Checked against the schema before it leaves the supervisor.
        bad = await run(client, ws, "double", DOUBLE, {"x": "21"})
        assert bad["error_kind"] == "bad_arguments"
        assert "x" in bad["output"]
        extra = await run(client, ws, "double", DOUBLE, {"x": 1, "y": 2})
        assert extra["error_kind"] == "bad_arguments"

        failing = await run(client, ws, "f", tool("f", [PY, "-c", "import sys; "
                            "print('half'); sys.exit(3)"]), {})
        assert (failing["is_error"], failing["exit_code"]) == (True, 3)
        assert failing["error_kind"] == "nonzero_exit"
        assert "half" in failing["output"]

        # A command that reads no stdin, given more than a pipe holds.
        deaf = await run(client, ws, "deaf", tool("deaf", ["/bin/echo", "fine"]),
                         {"blob": "z" * 300_000})
        assert not deaf["is_error"], deaf["output"]
        assert deaf["output"].strip() == "fine"

        # A flood is cut at the per-stream cap and killed, like shell output.
        flood = await run(client, ws, "flood", tool("flood", ["/usr/bin/yes"]), {})
        assert flood["error_kind"] == "output_limit"
        assert flood["truncated"]
        assert len(flood["output"]) < 1_100_000
