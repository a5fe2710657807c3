"""The SDK against one real embedded farm: a turn as typed events with a client
tool, a raising client tool, approvals, an interrupt within its bound, hooks
in the program, export/import round trip, the sync wrapper."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from supervisor.sdk import (
    AgentMessage,
    Corral,
    EmbeddedFarm,
    Event,
    ExecApprovalRequest,
    HookInput,
    HookResult,
    ImportRefused,
    SessionOptions,
    SupervisorError,
    SyncCorral,
    TokenCount,
    ToolCallBegin,
    ToolCallEnd,
    TurnAborted,
    TurnComplete,
    TurnStarted,
    import_checkpoint,
    tool,
)
from tests.helpers import searchable_dir, wait_until
from tests.sdk.farms import running_farm

module_loop = pytest.mark.asyncio(loop_scope="module")
INTERRUPT_BOUND_S = 5.0  # interrupt sent -> turn_aborted seen by the program
DROP_DEADLINE_S = 15.0  # a frozen program (1 s liveness) dropped by the supervisor


async def collect(stream: Any) -> list[Event]:
    return [e async for e in stream]


def dropped_holder(log: Path, session_id: str) -> bool:
    """The supervisor's log (INFO) names the client holding ``session_id``'s tools
    (its last registration), then that client dropped as silent."""
    text = log.read_text(errors="replace") if log.exists() else ""
    sid = re.escape(session_id)
    held = re.findall(rf"client ([0-9a-f]+) holds \d+ tool\(s\).* of session {sid}\n", text)
    return bool(held) and f"client {held[-1]} silent;" in text


@module_loop
async def test_a_turn_is_typed_events_and_the_client_tool_runs_here(
        farm: EmbeddedFarm, workspace: Path) -> None:
    seen: list[int] = []

    @tool
    def probe(x: int) -> str:
        """Record x."""
        seen.append(x)
        return f"probed {x}"

    async with farm.connect() as corral:
        session = await corral.create_session(SessionOptions(workspace=workspace,
                                                             approval="allow"), tools=[probe])
        events = await collect(session.run("go", timeout_s=30))
        # The export (at the tool boundary) holds the client tool call and its output.
        exported = json.dumps(await session.export())
    assert '"name": "probe"' in exported
    assert '"output": "probed 1"' in exported
    assert isinstance(events[0], TurnStarted)
    assert isinstance(events[-1], TurnComplete)
    assert events[-1].last_agent_message == "done"
    begin = next(e for e in events if isinstance(e, ToolCallBegin))
    end = next(e for e in events if isinstance(e, ToolCallEnd))
    assert (begin.name, begin.arguments) == ("probe", {"x": 1})
    assert (end.name, end.state, end.output, end.is_error) == ("probe", "ok", "probed 1", False)
    assert end.tier == "client"
    assert end.isolation["client"]["pid"] > 0
    assert seen == [1]
    assert any(isinstance(e, AgentMessage) and e.text == "done" for e in events)
    assert all(e.session_id == session.id for e in events)


@module_loop
async def test_a_client_tool_that_raises_is_a_typed_error_and_the_session_goes_on(
        farm: EmbeddedFarm, workspace: Path) -> None:
    calls: list[int] = []

    @tool
    async def probe(x: int) -> str:
        calls.append(x)
        if x == 1:
            raise ValueError("no such thing")
        return "fine"

    async with farm.connect() as corral:
        session = await corral.create_session(SessionOptions(workspace=workspace,
                                                             approval="allow"), tools=[probe])
        first = await collect(session.run("go", timeout_s=30))
        second = await collect(session.run("again", timeout_s=30))
    end = next(e for e in first if isinstance(e, ToolCallEnd))
    assert end.is_error
    assert end.state == "failed"
    assert end.error_kind == "client_tool_raised"
    assert "ValueError: no such thing" in end.output
    assert "Traceback" not in end.output
    assert isinstance(first[-1], TurnComplete)
    end2 = next(e for e in second if isinstance(e, ToolCallEnd))
    assert (end2.state, end2.output) == ("ok", "fine")
    assert calls == [1, 2]
    assert isinstance(second[-1], TurnComplete)


@module_loop
async def test_arguments_the_declared_schema_refuses_never_reach_the_program(
        farm: EmbeddedFarm, workspace: Path) -> None:
    calls: list[int] = []

    @tool(parameters={"type": "object", "required": ["x"], "additionalProperties": False,
                      "properties": {"x": {"type": "integer", "minimum": 2}}})
    def probe(x: int) -> str:
        calls.append(x)
        return "fine"

    async with farm.connect() as corral:
        session = await corral.create_session(SessionOptions(workspace=workspace,
                                                             approval="allow"), tools=[probe])
        first = await collect(session.run("go", timeout_s=30))  # probe(x=1): below minimum
        second = await collect(session.run("again", timeout_s=30))  # probe(x=2)
        with pytest.raises(SupervisorError, match="not a valid JSON Schema"):
            await corral.create_session(
                SessionOptions(workspace=workspace, approval="allow"),
                tools=[tool(name="broken", parameters={"type": "object",
                                                       "properties": {"x": {"type": 5}}})(
                    lambda x: "")])
    end = next(e for e in first if isinstance(e, ToolCallEnd))
    assert end.is_error
    assert end.error_kind == "bad_arguments", end
    assert "minimum" in end.output
    assert "Tool call not run" in end.output
    assert isinstance(first[-1], TurnComplete)
    end2 = next(e for e in second if isinstance(e, ToolCallEnd))
    assert (end2.state, end2.output) == ("ok", "fine")
    assert calls == [2]  # the refused call never ran


@module_loop
async def test_approval_rules_apply_to_client_tools(farm: EmbeddedFarm, workspace: Path,
                                                    ) -> None:
    ran: list[int] = []

    @tool
    def probe(x: int) -> str:
        ran.append(x)
        return "ok"

    async with farm.connect() as corral:
        session = await corral.create_session(SessionOptions(workspace=workspace,
                                                             approval="ask"), tools=[probe])
        events: list[Event] = []
        async for event in session.run("go", timeout_s=30):
            events.append(event)
            if isinstance(event, ExecApprovalRequest):
                assert [c.name for c in event.calls] == ["probe"]
                assert ran == []
                await session.approve(event.approval_id, "approved")
        assert ran == [1]
        assert isinstance(events[-1], TurnComplete)
        # A deny rule names the client tool like any other: it never runs.
        with searchable_dir("corral-sdk-ws-", "/tmp") as other:
            denied = await corral.create_session(SessionOptions(
                workspace=other, approval={"default": "allow", "deny": ["probe(*)"]}),
                tools=[probe])
            events = await collect(denied.run("go", timeout_s=30))
    end = next(e for e in events if isinstance(e, ToolCallEnd))
    assert end.state == "failed"
    assert "denied by rule probe(*)" in end.output
    assert ran == [1]


@module_loop
async def test_an_interrupt_reaches_a_running_client_tool_within_its_bound(
        farm: EmbeddedFarm, workspace: Path) -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()

    @tool
    async def probe(x: int) -> str:
        started.set()
        try:
            await asyncio.Event().wait()  # until the interrupt cancels it
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    async with farm.connect() as corral:
        session = await corral.create_session(SessionOptions(workspace=workspace,
                                                             approval="allow"), tools=[probe])
        events: list[Event] = []

        async def follow() -> None:
            async for event in session.run("go", timeout_s=30):
                events.append(event)

        async with asyncio.TaskGroup() as tg:
            tg.create_task(follow())
            async with asyncio.timeout(30):
                await started.wait()
            t0 = time.monotonic()
            assert await session.interrupt()
        took = time.monotonic() - t0
        async with asyncio.timeout(INTERRUPT_BOUND_S):
            await cancelled.wait()
    assert isinstance(events[-1], TurnAborted)
    assert events[-1].reason == "interrupted"
    assert took < INTERRUPT_BOUND_S, f"turn_aborted {took:.2f}s after the interrupt"


@module_loop
async def test_hooks_are_python_callables_of_the_program(farm: EmbeddedFarm,
                                                         workspace: Path) -> None:
    seen: list[Any] = []
    inputs: list[HookInput] = []

    @tool
    def probe(x: int) -> str:
        seen.append(x)
        return "raw"

    def pre_tool(inp: HookInput) -> HookResult:
        inputs.append(inp)
        return HookResult(arguments={"x": 41})

    async def post_tool(inp: HookInput) -> HookResult:
        return HookResult(output=f"hooked {inp.data['output']}")

    async with farm.connect() as corral:
        session = await corral.create_session(
            SessionOptions(workspace=workspace, approval="allow"), tools=[probe],
            hooks={"pre_tool": pre_tool, "post_tool": post_tool})
        events = await collect(session.run("go", timeout_s=30))
    end = next(e for e in events if isinstance(e, ToolCallEnd))
    assert seen == [41]
    assert end.output == "hooked raw"
    assert inputs[0].data["name"] == "probe"
    assert inputs[0].session_id == session.id


@module_loop
async def test_bad_options_and_colliding_names_are_typed_errors(farm: EmbeddedFarm,
                                                                workspace: Path) -> None:
    @tool(name="shell")
    def mine(command: str) -> str:
        return command

    async with farm.connect() as corral:
        with pytest.raises(SupervisorError) as err:
            await corral.create_session(SessionOptions(workspace=workspace), tools=[mine])
        assert err.value.kind == "bad_request"
        assert "collides" in err.value.message
        with pytest.raises(SupervisorError) as err:
            await corral.create_session(SessionOptions(workspace="/nonexistent-ws"))
        assert err.value.kind == "bad_request"
        with pytest.raises(SupervisorError) as err:
            await corral.resume("sess_nope")
        assert err.value.kind == "unknown_session"
        # A deadline that is not above 0 is a ValueError before the turn is sent (it
        # was an empty TimeoutError after the submit, the turn running on).
        session = await corral.create_session(SessionOptions(workspace=workspace))
        for bad in (-1, 0, "5"):
            with pytest.raises(ValueError, match="timeout_s must be a number of seconds"):
                async for _ in session.run("never sent", timeout_s=bad):  # type: ignore[arg-type]
                    pass
        described = await session.describe()
        assert int(described.get("queued_input", 0)) == 0
        assert described.get("active_turn") is None


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"workers": -1}, "workers must be a whole number"),
    ({"workers": True}, "workers must be a whole number"),
    ({"approval": "sometimes"}, "approval must be"),
    ({"log_level": "loud"}, "log_level must be one of"),
    ({"home": "/etc/hostname"}, "is not a directory (/etc/hostname is a file)"),
    ({"home": "/etc/hostname/sub"}, "is not a directory (/etc/hostname is a file)"),
])
def test_an_embedded_farm_refuses_bad_arguments_at_once(kwargs: dict[str, Any],
                                                        needle: str) -> None:
    """Before anything starts: workers=-1 started a farm with no worker; a home that
    is a file raised FileExistsError from the farm's start."""
    with pytest.raises(ValueError, match=re.escape(needle)):
        EmbeddedFarm(**kwargs)


@module_loop
async def test_export_then_import_resumes_the_session_in_another_farm(
        farm: EmbeddedFarm, workspace: Path, tmp_path: Path) -> None:
    async with farm.connect() as corral:
        session = await corral.create_session(SessionOptions(workspace=workspace,
                                                             approval="allow"))
        events = await collect(session.run("go", timeout_s=30))  # probe: unknown tool
        assert isinstance(events[-1], TurnComplete)
        checkpoint = await session.export()
    assert checkpoint["descriptor"]["session_id"] == session.id
    home = tmp_path / "other-home"
    home.mkdir()
    (home / "script.json").write_text((farm.home / "script.json").read_text())
    (home / "corral.toml").write_text((farm.home / "corral.toml").read_text())
    with searchable_dir("corral-sdk-ws-", "/tmp") as ws2:
        sid = await import_checkpoint(home, checkpoint, workspace=ws2, approval="allow")
        assert sid == session.id
        with pytest.raises(ImportRefused) as refused:
            await import_checkpoint(home, checkpoint, workspace=ws2, approval="allow")
        assert refused.value.kind == "store"
        async with running_farm(home=home, workers=1) as other, other.connect() as c2:
            resumed = await c2.resume(sid)
            again = await collect(resumed.run("again", timeout_s=30))
            history = await collect_until(resumed, again[-1].sequence)
    # The checkpoint is the one made at the turn's tool boundary: the imported
    # context holds the prompt, the call and its output, and goes on from there.
    # The scripted model answers by the count of model outputs in its context:
    # entry 1 ("done") proves the imported context holds the first step's call.
    assert isinstance(again[-1], TurnComplete)
    assert again[-1].last_agent_message == "done"
    texts = [e.payload.get("text") for e in history if e.type == "user_message"]
    assert texts == ["again"]
    usage = next(e for e in again if isinstance(e, TokenCount))
    assert usage.total["input"] > usage.last["input"]  # the usage came across too


async def collect_until(session: Any, last: int) -> list[Event]:
    out: list[Event] = []
    async for event in session.events(timeout_s=10):
        out.append(event)
        if event.sequence >= last:
            return out
    return out


@module_loop
async def test_the_sync_wrapper_works_inside_a_running_loop(farm: EmbeddedFarm,
                                                           workspace: Path) -> None:
    # This test body runs in an event loop, as a notebook cell does: the wrapper's
    # own loop thread does the work while this loop waits.
    @tool
    def probe(x: int) -> int:
        return x * 10

    with SyncCorral.connect(farm.endpoint) as corral:
        session = corral.create_session(SessionOptions(workspace=workspace, approval="allow"),
                                        tools=[probe])
        events = list(session.run("go", timeout_s=30))
        assert session.describe()["session_id"] == session.id
    end = next(e for e in events if isinstance(e, ToolCallEnd))
    assert end.output == "10"
    assert isinstance(events[-1], TurnComplete)


def test_the_sync_wrapper_works_without_a_loop(farm: EmbeddedFarm, workspace: Path) -> None:
    with SyncCorral.connect(farm.endpoint) as corral:
        session = corral.create_session(SessionOptions(workspace=workspace, approval="deny"))
        events = list(session.run("go", timeout_s=30))
    assert isinstance(events[-1], TurnComplete)


def test_corral_for_home_says_when_no_farm_runs(tmp_path: Path) -> None:
    from supervisor.sdk import SupervisorUnavailable

    with pytest.raises(SupervisorUnavailable):
        Corral.for_home(tmp_path)


@module_loop
async def test_a_hook_whose_program_is_gone_fails_closed(farm: EmbeddedFarm,
                                                         workspace: Path) -> None:
    ran: list[int] = []

    @tool
    def probe(x: int) -> str:
        ran.append(x)
        return "ran"

    async with farm.connect() as holder:
        session = await holder.create_session(
            SessionOptions(workspace=workspace, approval="allow", client_wait_s=0.5),
            tools=[probe], hooks={"pre_tool": lambda inp: None})
    # That program left; another holds the tool but not the hooks.
    async with farm.connect() as other:
        resumed = await other.resume(session.id, tools=[probe])
        events = await collect(resumed.run("go", timeout_s=30))
    end = next(e for e in events if isinstance(e, ToolCallEnd))
    assert end.state == "failed"
    assert "denied by a pre_tool hook" in end.output
    assert "not connected" in end.output
    assert ran == []
    assert isinstance(events[-1], TurnComplete)


@module_loop
async def test_a_script_model_gets_its_provider_for_the_connection(
        farm: EmbeddedFarm, workspace: Path, tmp_path: Path) -> None:
    script = tmp_path / "own.json"
    script.write_text('{"responses": [{"text": "from my own script"}]}')
    async with farm.connect() as corral:
        session = await corral.create_session(SessionOptions(workspace=workspace,
                                                             model=f"script:{script}"))
        events = await collect(session.run("hi", timeout_s=30))
        with pytest.raises(ValueError, match="does not exist"):
            await corral.create_session(SessionOptions(workspace=workspace,
                                                       model=f"script:{script}.missing"))
    assert isinstance(events[-1], TurnComplete)
    assert events[-1].last_agent_message == "from my own script"


@module_loop
async def test_a_program_dropped_while_frozen_holds_its_tools_again(
        farm: EmbeddedFarm, workspace: Path) -> None:
    @tool
    def probe(x: int) -> str:
        return f"still here {x}"

    async with farm.connect(liveness_s=1.0) as corral:
        session = await corral.create_session(SessionOptions(
            workspace=workspace, approval="allow", client_wait_s=0.5), tools=[probe])
        # The program freezes (its loop blocked, this wait the fault) past its 1 s
        # liveness window until the supervisor's log says it dropped this program,
        # the holder of the session's tool: no longer, and never past the deadline.
        wait_until(lambda: dropped_holder(farm.home / "logs" / "supervisor.log", session.id),
                   timeout_s=DROP_DEADLINE_S, interval_s=0.05,
                   what="the supervisor to drop the frozen program")
        events = await collect(session.run("go", timeout_s=30))
    end = next(e for e in events if isinstance(e, ToolCallEnd))
    assert (end.state, end.output) == ("ok", "still here 1")


@module_loop
async def test_a_50_mb_client_tool_result_is_cut_to_the_bound(farm: EmbeddedFarm,
                                                              workspace: Path) -> None:
    @tool
    def probe(x: int) -> str:
        return "y" * 50_000_000

    async with farm.connect() as corral:
        session = await corral.create_session(SessionOptions(workspace=workspace,
                                                             approval="allow"), tools=[probe])
        events = await collect(session.run("go", timeout_s=60))
        follow_up = await collect(session.run("again", timeout_s=60))
    end = next(e for e in events if isinstance(e, ToolCallEnd))
    assert end.state == "ok"
    assert end.payload["truncated"] is True  # cut to TOOL_OUTPUT_BYTES (the event shows 64 KiB)
    assert isinstance(events[-1], TurnComplete)
    assert isinstance(follow_up[-1], TurnComplete)


@module_loop
async def test_the_binding_names_mcp_servers_and_client_tools(
        farm: EmbeddedFarm, workspace: Path, tmp_path: Path) -> None:
    """A checkpoint binds the session's MCP servers (by spec) and client tools
    (by schema) as well as its built-ins and command tools: an import that
    would not give the session the same ones is refused, naming them; one
    that does is taken."""
    @tool
    def probe(x: int) -> str:
        """Probe."""
        return f"probed {x}"

    mcp = {"t": {"command": ["/bin/false"]}}  # never needs to start for the binding
    commands = {"double": {"description": "Double x.", "command": ["/bin/cat"],
                           "parameters": {"type": "object",
                                          "properties": {"x": {"type": "integer"}}}}}
    async with farm.connect() as corral:
        session = await corral.create_session(
            SessionOptions(workspace=workspace, approval="allow", mcp=mcp,
                           command_tools=commands), tools=[probe])
        events = await collect(session.run("go", timeout_s=60))
        assert isinstance(events[-1], TurnComplete)
        checkpoint = await session.export()
    binding = checkpoint["content"]["logical_resume"]["capability_binding"]
    assert [e["name"] for e in binding["mcp_servers"]] == ["t"]
    assert [e["name"] for e in binding["client_tools"]] == ["probe"]
    assert "double" in [e["name"] for e in binding["tools"]]
    home = tmp_path / "bound-home"
    home.mkdir()
    (home / "corral.toml").write_text((farm.home / "corral.toml").read_text())
    with searchable_dir("corral-sdk-ws-", "/tmp") as ws2:
        with pytest.raises(ImportRefused) as refused:
            await import_checkpoint(home, checkpoint, workspace=ws2, approval="allow")
        assert refused.value.kind == "binding"
        for named in ("tools differ (double)", "MCP servers differ (t)",
                      "client tools differ (probe)"):
            assert named in refused.value.message
        with pytest.raises(ImportRefused) as refused:  # another spec of the same name
            await import_checkpoint(home, checkpoint, workspace=ws2, approval="allow",
                                    mcp={"t": {"command": ["/bin/true"]}},
                                    command_tools=commands, tools=[probe])
        assert "MCP servers differ (t)" in refused.value.message
        sid = await import_checkpoint(home, checkpoint, workspace=ws2, approval="allow",
                                      mcp=mcp, command_tools=commands, tools=[probe])
    assert sid == session.id
