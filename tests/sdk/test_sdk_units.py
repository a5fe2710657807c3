"""The SDK's pure parts, without processes: the public surface, schemas from
type hints, a client tool's error results, event parsing, session options,
and the supervisor's check of client tool declarations."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import pytest

import supervisor.sdk as sdk
from supervisor.clienttools import declaration
from supervisor.sdk import (
    Event,
    ExecApprovalRequest,
    SessionOptions,
    ToolCallEnd,
    ToolOutcome,
    TurnAborted,
    parse_event,
    schema_from_hints,
    tool,
)
from supervisor.server import CallError

PUBLIC = {
    "AgentMessage", "AgentMessageDelta", "AgentReasoningDelta", "ApprovalCall", "CallError",
    "ClientTool", "ContextCompacted", "Corral", "Decision", "EmbeddedFarm", "ErrorEvent",
    "Event", "ExecApprovalRequest", "FarmError", "FrontendRender", "HookEvent",
    "HookFunction", "HookInput", "HookResult", "ImportRefused", "ModelStepCompleted",
    "ModelStepStarted", "Session", "SessionConfigured", "SessionOptions", "SupervisorError",
    "SupervisorUnavailable", "SyncCorral", "SyncSession", "TokenCount", "ToolCallBegin",
    "ToolCallEnd", "ToolCallOutputDelta", "ToolOutcome", "TurnAborted", "TurnComplete",
    "TurnStarted", "UserMessage", "WarningEvent", "import_checkpoint", "parse_event",
    "schema_from_hints", "tool",
}


def test_the_public_surface_is_pinned() -> None:
    assert set(sdk.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(sdk, name) is not None


def test_a_schema_comes_from_the_type_hints() -> None:
    def f(city: str, days: int, scale: float, exact: bool, tags: list[str],
          mode: Literal["a", "b"], extra: dict[str, int], note: str | None = None,
          pair: tuple[int, ...] = ()) -> str:
        return ""

    schema = schema_from_hints(f)
    assert schema["required"] == ["city", "days", "scale", "exact", "tags", "mode", "extra"]
    props = schema["properties"]
    assert props["city"] == {"type": "string"}
    assert props["days"] == {"type": "integer"}
    assert props["scale"] == {"type": "number"}
    assert props["exact"] == {"type": "boolean"}
    assert props["tags"] == {"type": "array", "items": {"type": "string"}}
    assert props["mode"] == {"enum": ["a", "b"]}
    assert props["extra"] == {"type": "object", "additionalProperties": {"type": "integer"}}
    assert props["note"] == {"anyOf": [{"type": "string"}, {"type": "null"}]}
    assert props["pair"] == {"type": "array", "items": {"type": "integer"}}
    assert schema["additionalProperties"] is False


class Thing:
    pass


def test_a_schema_the_hints_cannot_give_must_be_explicit() -> None:
    def f(thing: Thing) -> str:
        return ""

    with pytest.raises(TypeError, match="give parameters="):
        tool(f)
    explicit = tool(name="thing", parameters={"type": "object", "properties": {}})(f)
    assert explicit.name == "thing"
    assert explicit.parameters == {"type": "object", "properties": {}}


def test_the_description_is_the_docstrings_first_paragraph() -> None:
    @tool
    def weather(city: str) -> str:
        """The weather in a city.

        Long details the model does not need."""
        return city

    assert weather.declaration()["description"] == "The weather in a city."


def test_a_client_tool_never_raises_for_the_models_call() -> None:
    @tool
    def boom(x: int) -> str:
        raise RuntimeError("kaput")

    @tool
    async def fine(x: int) -> dict[str, Any]:
        return {"x": x}

    @tool
    def outcome(x: int) -> ToolOutcome:
        return ToolOutcome("nope", is_error=True, error_kind="mine")

    async def go() -> list[ToolOutcome]:
        return [await boom.invoke({"x": 1}), await boom.invoke({"y": 1}),
                await fine.invoke({"x": 2}), await outcome.invoke({"x": 3})]

    raised, bad, ok, own = asyncio.run(go())
    assert (raised.is_error, raised.error_kind) == (True, "client_tool_raised")
    assert "RuntimeError: kaput" in raised.output
    assert (bad.is_error, bad.error_kind) == (True, "bad_arguments")
    assert (ok.output, ok.is_error) == ('{"x": 2}', False)
    assert own == ToolOutcome("nope", True, "mine")


def test_events_parse_into_their_dataclasses_and_never_raise() -> None:
    end = parse_event({"type": "tool_call_end", "session_id": "s", "sequence": 7,
                       "submission_id": "sub", "created_at": 1.5, "payload": {
                           "turn_id": "t", "call_id": "c", "name": "probe", "output": "o",
                           "is_error": True, "state": "unknown", "outcome": "unknown",
                           "isolation": {"tier": "client"},
                           "error": {"kind": "worker_lost", "message": "m",
                                     "retryable": True}}})
    assert isinstance(end, ToolCallEnd)
    assert (end.turn_id, end.state, end.tier, end.durable) == ("t", "unknown", "client", True)
    assert end.error is not None
    assert end.error.kind == "worker_lost"
    ask = parse_event({"type": "exec_approval_request", "session_id": "s", "sequence": 3,
                       "payload": {"id": "a1", "calls": [
                           {"call_id": "c", "name": "probe", "arguments": {"x": 1}}, "junk"]}})
    assert isinstance(ask, ExecApprovalRequest)
    assert ask.approval_id == "a1"
    assert [c.name for c in ask.calls] == ["probe"]
    aborted = parse_event({"type": "turn_aborted", "payload": {"reason": 5}})
    assert isinstance(aborted, TurnAborted)
    assert aborted.reason == ""
    unknown = parse_event({"type": "from_the_future", "payload": None, "sequence": "x"})
    assert type(unknown) is Event
    assert unknown.sequence == 0


def test_session_options_carry_every_cli_option_and_pass_mcp_and_tools_through() -> None:
    mcp = {"git": {"command": ["mcp-server-git"], "network": False}}
    tools = {"fmt": {"command": ["fmt"], "parameters": {"type": "object"}}}
    spec = SessionOptions(workspace="/tmp", model="openai-chat:qwen",
                          base_url="http://127.0.0.1:9/v1", approval="deny",
                          sandbox="read-only", allow_git_write=True, mcp=mcp,
                          command_tools=tools, client_wait_s=2.0).to_spec()
    assert spec["route_spec"]["provider"] == "openai-chat"
    assert spec["route_spec"]["base_url"] == "http://127.0.0.1:9/v1"
    assert (spec["approval"], spec["sandbox_mode"], spec["git_writable"]) == (
        "deny", "read-only", True)
    assert spec["mcp"] == mcp
    assert spec["tools"] == tools
    assert spec["client_wait_s"] == 2.0
    assert SessionOptions(workspace="/tmp", model="main").to_spec() == {
        "workspace": "/tmp", "route": "main"}


@pytest.mark.parametrize(("tools", "why"), [
    ([{"name": "shell"}], "collides"),
    ([{"name": "mcp__git__log"}], "collides"),
    ([{"name": "a"}, {"name": "a"}], "collides"),
    ([{"name": "9lives"}], "must match"),
    ([{"name": "ok", "parameters": {"type": "array"}}], "type 'object'"),
    ([{"name": "ok", "extra": 1}], "must be a map"),
    ([{"name": f"t{i}"} for i in range(65)], "at most 64"),
])
def test_the_supervisor_refuses_bad_client_tool_declarations(tools: Any, why: str) -> None:
    with pytest.raises(CallError, match=why):
        declaration({"client_tools": tools})


def test_a_client_tool_may_not_take_a_command_tools_name() -> None:
    with pytest.raises(CallError, match="command tool"):
        declaration({"client_tools": [{"name": "fmt"}], "tools": {"fmt": {}}})


def test_a_good_declaration_lands_in_the_sessions_extra() -> None:
    spec: dict[str, Any] = {"workspace": "/w", "client_tools": [{"name": "probe"}],
                            "client_hooks": ["pre_tool"], "client_wait_s": 1}
    extra = declaration(spec)
    assert spec == {"workspace": "/w"}
    assert extra == {"client_tools": [{"name": "probe", "description": "",
                                       "parameters": {"type": "object", "properties": {}}}],
                     "client_hooks": ["pre_tool"], "client_wait_s": 1.0}
    with pytest.raises(CallError, match="client_hooks"):
        declaration({"client_hooks": ["nope"]})
    with pytest.raises(CallError, match="client_wait_s"):
        declaration({"client_tools": [{"name": "p"}], "client_wait_s": 301})
