"""The tools a session offers to the model, as ``ToolSchema`` shapes.

The argument names follow the tool service (``sandbox_worker`` tools):
``shell {command, workdir?, timeout_s?}``, ``read_file {path, offset?, limit?}``,
``write_file {path, content}``, ``edit_file {path, old, new, count?}``,
``list_dir {path?}`` (paths relative to the workspace).

Outside tools (docs/tools.md) are offered here too: the session's command
tools (``SessionSpec.command_tools``) and the tools its MCP servers list
(``SessionSpec.mcp``; listed through ``supervisor.tools.router`` by
``discover`` before each model step, until a server has answered once).

Invariants:
- A name is offered when it is a built-in of ``SessionSpec.tools``, a command
  tool of the session, or a tool its MCP server listed with a usable schema;
  a call to any other name is answered locally with an error output (never
  dispatched).
- A tool is idempotent on worker loss only when it says so: the built-ins of
  ``IDEMPOTENT_TOOLS``, a command tool's ``idempotent``/``read_only`` flags, an
  MCP tool's ``idempotentHint``/``readOnlyHint``; everything else is
  side-effecting (``unknown`` after a lost worker).
- Client tools (``extra["client_tools"]``, ``supervisor/clienttools.py``)
  are offered too; they are never idempotent and run in the program that
  declared them (``engine/routers.py``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Final, Protocol

from sandbox_worker.api import (
    IDEMPOTENT_TOOLS,
    READ_ONLY_TOOLS,
    TOOL_NAMES,
    McpCall,
    ToolCallRequest,
    ToolSchema,
)
from supervisor.engine.calls import tool_sender
from supervisor.engine.errors import CallFailed
from supervisor.tools.router import router_for, split_mcp_name

if TYPE_CHECKING:
    from supervisor.engine.config import EngineConfig, SessionSpec


class Session(Protocol):
    """What tooling reads of a session (a Protocol: no import of session.py,
    which would put this module in the engine's import circle)."""

    @property
    def sid(self) -> Any: ...
    @property
    def spec(self) -> SessionSpec: ...
    @property
    def config(self) -> EngineConfig: ...
    @property
    def manager(self) -> Any: ...

    async def warn(self, message: str, submission_id: Any = None, **extra: Any) -> None: ...


class Turn(Protocol):
    @property
    def session(self) -> Any: ...
    @property
    def submission_id(self) -> Any: ...

    def budget_s(self, cap_s: float) -> float: ...

log = logging.getLogger(__name__)
DISCOVER_BUDGET_S: Final = 60.0


def _obj(props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


_STR: Final = {"type": "string"}
_INT: Final = {"type": "integer", "minimum": 0}
_DESCRIPTIONS: Final[dict[str, tuple[str, dict[str, Any]]]] = {
    "shell": ("Run a bash command line in the sandboxed workspace (no network unless granted). "
              "Output streams back; stdout and stderr are capped.",
              _obj({"command": _STR, "workdir": _STR, "timeout_s": {"type": "number"}},
                   ["command"])),
    "read_file": ("Read a UTF-8 text file of the workspace, by lines.",
                  _obj({"path": _STR, "offset": _INT, "limit": _INT}, ["path"])),
    "write_file": ("Create or overwrite a file in the workspace (parents are created).",
                   _obj({"path": _STR, "content": _STR}, ["path", "content"])),
    "edit_file": ("Replace exact text in a workspace file; fails if the text is missing, "
                  "or ambiguous without 'count'.",
                  _obj({"path": _STR, "old": _STR, "new": _STR, "count": _INT},
                       ["path", "old", "new"])),
    "list_dir": ("List a directory of the workspace.", _obj({"path": _STR}, [])),
}


def tool_schemas(names: list[str], extra: dict[str, Any] | None = None) -> list[ToolSchema]:
    out: list[ToolSchema] = []
    for name in names:
        if name not in TOOL_NAMES or name not in _DESCRIPTIONS:
            continue
        description, parameters = _DESCRIPTIONS[name]
        out.append(ToolSchema(name=name, description=description, parameters=parameters,
                              idempotent=name in IDEMPOTENT_TOOLS,
                              read_only=name in READ_ONLY_TOOLS))
    return out + client_tool_schemas(extra)


def offered(names: list[str], tool: str, extra: dict[str, Any] | None = None) -> bool:
    if tool in TOOL_NAMES:
        return tool in names
    return any(t["name"] == tool for t in client_tool_schemas(extra))


# -- outside tools -------------------------------------------------------------

def _command_schemas(s: Session) -> list[ToolSchema]:
    return _commands(s.spec)


def _commands(spec: SessionSpec) -> list[ToolSchema]:
    return [ToolSchema(name=name, description=tool["description"],
                       parameters=tool["parameters"],
                       idempotent=bool(tool["idempotent"] or tool["read_only"]),
                       read_only=bool(tool["read_only"]))
            for name, tool in spec.command_tools.items()]


def spec_schemas(spec: SessionSpec) -> list[ToolSchema]:
    """The tools a session's spec alone determines (built-ins and command
    tools): the ``tools`` of a checkpoint's capability binding. MCP tools are
    listed by their servers at run time: the binding names their servers'
    specs instead (``session_binding``)."""
    return [*tool_schemas(spec.tools), *_commands(spec)]


def session_binding(spec: SessionSpec) -> dict[str, Any]:
    """A checkpoint's capability binding for a session of ``spec``: its
    built-ins and command tools (``spec_schemas``), its policy, its MCP
    servers by spec and its client tools by declaration. An export and an
    import both build it here, so they agree by construction."""
    from supervisor.export.checkpoint import capability_binding

    return capability_binding(
        spec_schemas(spec), {"approval": spec.approval, "tool_policy": dict(spec.tool_policy)},
        mcp_servers=spec.mcp, client_tools=client_tool_schemas(spec.extra))


def _mcp_schemas(s: Session) -> list[ToolSchema]:
    router = router_for(s.manager.broker)
    out: list[ToolSchema] = []
    for server in s.spec.mcp:
        listed = router.listed(s.sid, server)
        if listed is not None:
            out.extend(listed.schemas.values())
    return out


def offered_schemas(s: Session) -> list[ToolSchema]:
    """Every tool the session offers the model now."""
    return [*tool_schemas(s.spec.tools, s.spec.extra), *_command_schemas(s),
            *_mcp_schemas(s)]


def _find(s: Session, tool: str) -> ToolSchema | None:
    if tool in s.spec.command_tools:
        return _command_schemas(s)[list(s.spec.command_tools).index(tool)]
    parts = split_mcp_name(tool)
    if parts is None or parts[0] not in s.spec.mcp:
        return None
    listed = router_for(s.manager.broker).listed(s.sid, parts[0])
    return listed.schemas.get(tool) if listed is not None else None


def offered_in(s: Session, tool: str) -> bool:
    """Whether the session offers ``tool`` (an MCP tool of a server not listed
    yet, e.g. after a restart, counts: the router lists it at the call)."""
    if offered(s.spec.tools, tool, s.spec.extra) or tool in s.spec.command_tools:
        return True
    parts = split_mcp_name(tool)
    if parts is None or parts[0] not in s.spec.mcp:
        return False
    listed = router_for(s.manager.broker).listed(s.sid, parts[0])
    return listed is None or tool in listed.schemas or tool in listed.broken


def idempotent_in(s: Session, tool: str) -> bool:
    """Whether a call of ``tool`` may run again after its worker was lost."""
    if tool in TOOL_NAMES:
        return tool in IDEMPOTENT_TOOLS
    found = _find(s, tool)
    return bool(found and found["idempotent"])


def base_request(s: Session, call_id: str, tool: str, arguments: dict[str, Any]
                 ) -> ToolCallRequest:
    request = ToolCallRequest(call_id=call_id, tool=tool, arguments=arguments,
                              session_id=s.sid, workspace=s.spec.workspace,
                              policy=s.spec.tool_policy)
    identity = s.spec.extra.get("workspace_identity")
    if isinstance(identity, list):  # pinned at creation (facade)
        request["workspace_identity"] = identity
        request["workspace_host"] = str(s.spec.extra.get("workspace_host", ""))
    return request


def outside_request(s: Session, request: ToolCallRequest) -> ToolCallRequest:
    """``request`` with what a command tool or MCP call needs attached."""
    tool = request["tool"]
    if tool in TOOL_NAMES:
        return request
    if tool in s.spec.command_tools:
        request["command_tool"] = s.spec.command_tools[tool]
        return request
    parts = split_mcp_name(tool)
    if parts is not None and parts[0] in s.spec.mcp:
        request["mcp"] = McpCall(server=parts[0], spec=s.spec.mcp[parts[0]], op="call",
                                 tool=parts[1])
    return request


async def discover(turn: Turn) -> None:
    """List the session's MCP servers that have not answered yet (starting
    them on a worker); a server that fails is left out of this step, and the
    turn gets a warning naming why (its stderr's last lines)."""
    s = turn.session
    router = router_for(s.manager.broker)
    for server, spec in s.spec.mcp.items():
        if router.listed(s.sid, server) is not None:
            continue
        request = base_request(s, f"mcp-list-{server}", f"mcp__{server}", {})
        request["mcp"] = McpCall(server=server, spec=spec, op="list", tool="")
        why: str | None
        send = tool_sender(s.manager.broker, budget_s=turn.budget_s(DISCOVER_BUDGET_S),
                           cancel_grace_s=s.config.cancel_grace_s)
        try:
            listed, why = await router.list_tools(send, request, server)
        except CallFailed as f:
            listed, why = None, f"{f.kind}: {f.message}"
        if listed is None:
            await s.warn(f"MCP server {server!r} is not available this step: {why}",
                         turn.submission_id, mcp_server=server)
            continue
        for name, reason in listed.broken.items():
            log.warning("session %s: %s not offered: %s", s.sid, name, reason)
            await s.warn(f"MCP tool {name!r} is not offered: {reason}", turn.submission_id,
                         mcp_server=server, error_kind="invalid_schema")


# -- client tools (sdk helper): declared once, checked by the facade ---------
def client_tool_schemas(extra: dict[str, Any] | None) -> list[ToolSchema]:
    """The client tools a session's config declares (``extra["client_tools"]``)."""
    declared = (extra or {}).get("client_tools")
    if not isinstance(declared, list):
        return []
    return [ToolSchema(name=str(t["name"]), description=str(t.get("description", "")),
                       parameters=dict(t.get("parameters") or {}), idempotent=False,
                       read_only=False)
            for t in declared if isinstance(t, dict) and isinstance(t.get("name"), str)]
