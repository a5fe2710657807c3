"""The tools a session offers to the model, as ``ToolSchema`` shapes.

The argument names follow the tool service (``sandbox_worker`` tools):
``shell {command, workdir?, timeout_s?}``, ``read_file {path, offset?, limit?}``,
``write_file {path, content}``, ``edit_file {path, old, new, count?}``,
``list_dir {path?}`` (paths relative to the workspace).

Invariants:
- Only names in ``sandbox_worker.api.TOOL_NAMES`` can be offered, plus the
  client tools declared in the session's config (``extra["client_tools"]``,
  ``supervisor/clienttools.py``); a call to any other name is answered
  locally with an error output (never dispatched).
"""

from __future__ import annotations

from typing import Any, Final

from sandbox_worker.api import IDEMPOTENT_TOOLS, READ_ONLY_TOOLS, TOOL_NAMES, ToolSchema


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
