"""Parsing and validation of outside-tool specs: ``[mcp.NAME]`` and
``[tools.NAME]`` of corral.toml, and the same maps given per session (the
session-create request's ``mcp`` and ``tools``).

Every error is a ``SpecError`` whose message names the table and key and says
what to write instead; nothing here touches the network or a process.

Invariants:
- A returned spec has exactly the documented keys with the documented types
  (``sandbox_worker.api.McpServerSpec`` / ``CommandToolSpec``).
- No name collides with a built-in tool, and every name the model will see
  (``NAME`` of a command tool, ``mcp__NAME__TOOL``) fits the providers'
  function-name rule (``TOOL_NAME_RE``).
- A command tool's ``parameters`` is a valid JSON Schema for an object
  (checked with the same library that validates the calls, ``schema.py``).
- An HTTP server's credentials are named (an environment variable of the
  worker), never given: no spec holds a secret, so none reaches the store.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from sandbox_worker.api import (
    MCP_HEADER_ENV_PREFIX,
    MCP_PREFIX,
    TOOL_NAME_RE,
    TOOL_NAMES,
    CommandToolSpec,
    McpServerSpec,
)
from supervisor.tools.schema import SchemaProblem, check_schema

MAX_SERVERS: Final = 16
MAX_COMMAND_TOOLS: Final = 64
MAX_ARGV: Final = 256
MAX_ARG_CHARS: Final = 4096
MAX_DESCRIPTION_CHARS: Final = 4096
# mcp__NAME__TOOL must fit 64 characters: NAME gets at most 20 of them.
MAX_SERVER_NAME_CHARS: Final = 20
_MCP_KEYS: Final = {"command", "env", "cwd", "network", "url", "headers_env",
                    "start_timeout_s"}
# A server's start (spawn or connect, initialize, tools/list): default and bounds.
START_TIMEOUT_S: Final = 30.0
MAX_START_TIMEOUT_S: Final = 300.0
_TOOL_KEYS: Final = {"description", "parameters", "command", "idempotent", "read_only"}


class SpecError(ValueError):
    """A ``[mcp.NAME]`` / ``[tools.NAME]`` spec that cannot be used; the
    message says where and what to fix."""


def _argv(where: str, value: Any) -> list[str]:
    if (not isinstance(value, list) or not value or len(value) > MAX_ARGV
            or not all(isinstance(a, str) and a and len(a) <= MAX_ARG_CHARS
                       and "\0" not in a for a in value)):
        raise SpecError(f"[{where}] command must be a non-empty list of strings (argv, no "
                        f"shell), e.g. command = [\"mcp-server-time\"]; got {value!r:.200}")
    return list(value)


def _str_map(where: str, key: str, value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and k and isinstance(v, str) and "\0" not in k + v
            for k, v in value.items()):
        raise SpecError(f"[{where}] {key} must be a table of strings, e.g. "
                        f"{key} = {{ NAME = \"value\" }}")
    return dict(value)


def parse_mcp_server(name: str, raw: Any) -> McpServerSpec:
    where = f"mcp.{name}"
    if not isinstance(name, str) or not TOOL_NAME_RE.fullmatch(name) or "__" in name \
            or len(name) > MAX_SERVER_NAME_CHARS:
        raise SpecError(f"[{where}] the server name must be 1-{MAX_SERVER_NAME_CHARS} letters, "
                        "digits, '-' or '_' without '__' (its tools are offered as "
                        "mcp__NAME__TOOL)")
    if not isinstance(raw, Mapping):
        raise SpecError(f"[{where}] must be a table with command = [...] or url = \"...\"")
    unknown = set(raw) - _MCP_KEYS
    if unknown:
        raise SpecError(f"[{where}] unknown key(s) {sorted(unknown)}; allowed: "
                        f"{sorted(_MCP_KEYS)}")
    if ("command" in raw) == ("url" in raw):
        raise SpecError(f"[{where}] needs exactly one of command = [...] (a stdio server, run "
                        "in the sandbox) or url = \"https://...\" (a streamable-HTTP server)")
    spec = McpServerSpec()
    if "command" in raw:
        spec["command"] = _argv(where, raw["command"])
        if "env" in raw:
            spec["env"] = _str_map(where, "env", raw["env"])
        if "cwd" in raw:
            cwd = raw["cwd"]
            if not isinstance(cwd, str) or cwd.startswith("/") or ".." in cwd.split("/"):
                raise SpecError(f"[{where}] cwd must be a path relative to the workspace "
                                "(no leading '/', no '..')")
            spec["cwd"] = cwd
        network = raw.get("network", False)
        if not isinstance(network, bool):
            raise SpecError(f"[{where}] network must be true or false")
        spec["network"] = network
        if "headers_env" in raw:
            raise SpecError(f"[{where}] headers_env is for url servers only")
    else:
        url = raw["url"]
        if not isinstance(url, str) or not url.startswith(("http://", "https://")) \
                or len(url) > 2048:
            raise SpecError(f"[{where}] url must be an http:// or https:// URL")
        for key in ("env", "cwd", "network"):
            if key in raw:
                raise SpecError(f"[{where}] {key} is for command (stdio) servers only; an "
                                "HTTP server is called from the worker")
        spec["url"] = url
        if "headers_env" in raw:
            # The values are environment variable *names* on the worker.
            headers = _str_map(where, "headers_env", raw["headers_env"])
            for var in headers.values():
                if not var.startswith(MCP_HEADER_ENV_PREFIX):
                    raise SpecError(f"[{where}] headers_env may name only worker variables "
                                    f"starting {MCP_HEADER_ENV_PREFIX} (got {var!r}), so that "
                                    "no spec can send another secret of the worker to a server")
            spec["headers_env"] = headers
    if "start_timeout_s" in raw:
        timeout = raw["start_timeout_s"]
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) \
                or not 0 < timeout <= MAX_START_TIMEOUT_S:
            raise SpecError(f"[{where}] start_timeout_s must be a number of seconds above 0 "
                            f"and at most {MAX_START_TIMEOUT_S:g} (default "
                            f"{START_TIMEOUT_S:g}), e.g. start_timeout_s = 60")
        spec["start_timeout_s"] = float(timeout)
    return spec


def parse_command_tool(name: str, raw: Any) -> CommandToolSpec:
    where = f"tools.{name}"
    if not isinstance(name, str) or not TOOL_NAME_RE.fullmatch(name):
        raise SpecError(f"[{where}] a tool name must be 1-64 letters, digits, '-' or '_'")
    if name in TOOL_NAMES:
        raise SpecError(f"[{where}] {name!r} is a built-in tool; choose another name")
    if name.startswith(MCP_PREFIX):
        raise SpecError(f"[{where}] names starting with {MCP_PREFIX!r} are MCP tools'")
    if not isinstance(raw, Mapping):
        raise SpecError(f"[{where}] must be a table with description, parameters, command")
    unknown = set(raw) - _TOOL_KEYS
    if unknown:
        raise SpecError(f"[{where}] unknown key(s) {sorted(unknown)}; allowed: "
                        f"{sorted(_TOOL_KEYS)}")
    description = raw.get("description")
    if not isinstance(description, str) or not description.strip() \
            or len(description) > MAX_DESCRIPTION_CHARS:
        raise SpecError(f"[{where}] description must be a non-empty string (what the model "
                        f"reads), at most {MAX_DESCRIPTION_CHARS} characters")
    parameters = raw.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, Mapping) or parameters.get("type") != "object":
        raise SpecError(f"[{where}] parameters must be a JSON Schema of an object, e.g. "
                        "parameters = { type = \"object\", properties = { q = { type = "
                        "\"string\" } }, required = [\"q\"] }")
    try:
        check_schema(dict(parameters))
    except SchemaProblem as exc:
        raise SpecError(f"[{where}] parameters is not a valid JSON Schema: {exc}") from None
    flags = {}
    for key in ("idempotent", "read_only"):
        value = raw.get(key, False)
        if not isinstance(value, bool):
            raise SpecError(f"[{where}] {key} must be true or false")
        flags[key] = value
    return CommandToolSpec(description=description, parameters=dict(parameters),
                           command=_argv(where, raw.get("command")),
                           idempotent=flags["idempotent"], read_only=flags["read_only"])


def parse_mcp_servers(raw: Any) -> dict[str, McpServerSpec]:
    """The ``mcp`` map (server name -> spec)."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise SpecError("mcp must be a map of server name -> {command = [...]} or {url}")
    if len(raw) > MAX_SERVERS:
        raise SpecError(f"at most {MAX_SERVERS} MCP servers per session")
    return {name: parse_mcp_server(name, spec) for name, spec in raw.items()}


def parse_command_tools(raw: Any) -> dict[str, CommandToolSpec]:
    """The ``tools`` map (tool name -> command tool spec)."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise SpecError("tools must be a map of tool name -> {description, parameters, "
                        "command}")
    if len(raw) > MAX_COMMAND_TOOLS:
        raise SpecError(f"at most {MAX_COMMAND_TOOLS} command tools per session")
    return {name: parse_command_tool(name, spec) for name, spec in raw.items()}


def merged(defaults: Mapping[str, Any] | None, given: Mapping[str, Any] | None
           ) -> dict[str, Any]:
    """corral.toml's entries overridden per name by a session's own."""
    out = dict(defaults or {})
    out.update(given or {})
    return out
