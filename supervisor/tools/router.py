"""Where a session's outside-tool calls go, and what its MCP servers offer.

One ``Router`` per broker client (``router_for``): the supervisor's process
has one. It remembers, per (session, MCP server), the pinned service of the
worker that holds the server (``tool@PIN``, from each answer's ``pin``) and
the tools the server listed. Both are caches: lost on a supervisor restart,
they are rebuilt by the next list or call (which starts the server again).

Affinity (docs/tools.md): a session's MCP calls go to ``tool@PIN`` once known.
The broker fails a pinned request at once with ``unroutable`` when no
registered worker serves that name (never queued, never dispatched): the
router forgets the pin and sends the same request to ``tool``, whose worker
starts the server. A call lost in flight (``worker_lost``) forgets the pin and
is re-raised: the engine decides (``unknown``, or a retry of an idempotent
or read-only tool, which then lands on another worker).

Invariants:
- Arguments are validated against the tool's declared schema (``schema.py``)
  here, before anything leaves the supervisor; invalid arguments get an error
  result with ``error_kind`` ``bad_arguments`` and are never sent.
- Nothing here holds a secret: specs name credentials, never carry them.
- The caches are bounded (``MAX_SESSIONS`` sessions, least recently used out).
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Final, cast

from broker.protocol import FailureKind
from sandbox_worker.api import (
    MCP_PREFIX,
    SERVICE_TOOL,
    TOOL_NAME_RE,
    McpToolInfo,
    ToolCallRequest,
    ToolCallResult,
    ToolSchema,
)
from supervisor.engine.errors import CallFailed
from supervisor.tools.schema import ArgumentsInvalid, SchemaProblem, check_schema, validate

log = logging.getLogger(__name__)

MAX_SESSIONS: Final = 4096
Send = Callable[[str, dict[str, Any]], Awaitable[ToolCallResult]]


def mcp_name(server: str, tool: str) -> str:
    return f"{MCP_PREFIX}{server}__{tool}"


def split_mcp_name(name: str) -> tuple[str, str] | None:
    """(server, tool) of ``mcp__SERVER__TOOL``; server names hold no ``__``."""
    if not name.startswith(MCP_PREFIX):
        return None
    server, sep, tool = name[len(MCP_PREFIX):].partition("__")
    return (server, tool) if sep and server and tool else None


class Listed:
    """What one server offers: its usable tools as schemas, and the tools it
    declared unusably (name -> why)."""

    def __init__(self, server: str, tools: list[McpToolInfo]) -> None:
        self.schemas: dict[str, ToolSchema] = {}
        self.broken: dict[str, str] = {}
        for info in tools:
            name = mcp_name(server, str(info.get("name", "")))
            if not TOOL_NAME_RE.fullmatch(name):
                self.broken[name[:80]] = ("its name does not fit the model's function names "
                                          "(letters, digits, '_', '-', at most 64)")
                continue
            schema = info.get("input_schema")
            try:
                check_schema(schema)
                if not isinstance(schema, dict) or schema.get("type", "object") != "object":
                    raise SchemaProblem("an input schema must describe an object")
            except SchemaProblem as exc:
                self.broken[name] = f"it declares an invalid input schema: {exc}"
                continue
            self.schemas[name] = ToolSchema(
                name=name, description=str(info.get("description", "")), parameters=schema,
                idempotent=bool(info.get("idempotent")) or bool(info.get("read_only")),
                read_only=bool(info.get("read_only")))


class Router:
    def __init__(self) -> None:
        self._pins: OrderedDict[str, dict[str, str]] = OrderedDict()
        self._listed: OrderedDict[str, dict[str, Listed]] = OrderedDict()

    # -- caches -------------------------------------------------------------
    def _touch(self, table: OrderedDict[str, Any], sid: str) -> dict[str, Any]:
        entry: dict[str, Any] = table.setdefault(sid, {})
        table.move_to_end(sid)
        while len(table) > MAX_SESSIONS:
            table.popitem(last=False)
        return entry

    def listed(self, sid: str, server: str) -> Listed | None:
        return self._listed.get(sid, {}).get(server)

    def forget(self, sid: str) -> None:
        self._pins.pop(sid, None)
        self._listed.pop(sid, None)

    # -- MCP ----------------------------------------------------------------
    async def _send_mcp(self, send: Send, sid: str, server: str,
                        payload: dict[str, Any]) -> ToolCallResult:
        pins = self._touch(self._pins, sid)
        pin = pins.get(server)
        result: ToolCallResult | None = None
        if pin is not None:
            try:
                result = await send(pin, payload)
            except CallFailed as f:
                if f.kind == FailureKind.UNROUTABLE:
                    pins.pop(server, None)  # never dispatched: safe to send again
                else:
                    if f.worker_lost:
                        pins.pop(server, None)
                    raise
        if result is None:
            try:
                result = await send(SERVICE_TOOL, payload)
            except CallFailed as f:
                if f.worker_lost:
                    pins.pop(server, None)
                raise
        got = result.get("pin")
        if isinstance(got, str) and got:
            pins[server] = got
        return result

    async def list_tools(self, send: Send, request: ToolCallRequest, server: str
                         ) -> tuple[Listed | None, str | None]:
        """Start (if needed) and list ``server``; (listing, None) or (None, why)."""
        sid = request["session_id"]
        result = await self._send_mcp(send, sid, server, dict(request))
        if result.get("is_error"):
            return None, result["output"]
        listed = Listed(server, list(result.get("mcp_tools") or []))
        self._touch(self._listed, sid)[server] = listed
        return listed, None

    async def call(self, send: Send, request: ToolCallRequest) -> ToolCallResult:
        """One outside-tool call: validated here, then sent (MCP: pinned)."""
        tool = request["tool"]
        command = request.get("command_tool")
        if command is not None:
            bad = _invalid(command.get("parameters"), request["arguments"])
            if bad is not None:
                return refused(request, *bad)
            return await send(SERVICE_TOOL, dict(request))
        mcp = request.get("mcp")
        if mcp is None:
            return await send(SERVICE_TOOL, dict(request))
        sid, server = request["session_id"], mcp["server"]
        listed = self.listed(sid, server)
        if listed is None:  # e.g. after a supervisor restart: list (and start) first
            listing = ToolCallRequest(**{**request, "arguments": {},
                                         "mcp": {**mcp, "op": "list", "tool": ""}})
            listed, why = await self.list_tools(send, listing, server)
            if listed is None:
                return refused(request, "mcp_start_failed", why or "the server did not start")
        schema = listed.schemas.get(tool)
        if schema is None:
            why = listed.broken.get(tool)
            if why is not None:
                return refused(request, "invalid_schema",
                               f"MCP tool {tool!r} cannot be called: {why}")
            return refused(request, "unknown_tool", f"MCP server {server!r} offers no tool "
                           f"{tool!r}; it offers: {', '.join(sorted(listed.schemas))}")
        bad = _invalid(schema["parameters"], request["arguments"])
        if bad is not None:
            return refused(request, *bad)
        return await self._send_mcp(send, sid, server, dict(request))


def _invalid(schema: Any, arguments: Any) -> tuple[str, str] | None:
    try:
        validate(schema, arguments)
    except ArgumentsInvalid as exc:
        return "bad_arguments", f"Tool call not run: {exc}"
    except SchemaProblem as exc:
        return "invalid_schema", f"Tool call not run: the tool's schema is unusable: {exc}"
    return None


def refused(request: ToolCallRequest, kind: str, message: str) -> ToolCallResult:
    """The result of a call the supervisor did not send: nothing ran, so it has
    no isolation record (``None``: no sandbox was involved)."""
    return ToolCallResult(
        call_id=request["call_id"], tool=request["tool"], outcome="error", is_error=True,
        output=message, exit_code=None, signal=None, duration_s=0.0, stdout_bytes=0,
        stderr_bytes=0, truncated=False, isolation=cast(Any, None), error_kind=kind)


_routers: weakref.WeakKeyDictionary[Any, Router] = weakref.WeakKeyDictionary()


def router_for(broker: Any) -> Router:
    """The router of this broker client (one per supervisor process)."""
    router = _routers.get(broker)
    if router is None:
        router = _routers[broker] = Router()
    return router
