"""Published tool schemas (JSON schema of each tool's arguments) and the
validation of incoming arguments against them.

Validation is hand-written for these five small schemas (no jsonschema
dependency) and produces messages a model can act on ("'path' must be a
string", "unknown argument 'fle'").

Invariants:
- ``SCHEMAS`` and ``validate`` agree: every property a schema publishes is
  accepted, every required one is demanded, nothing else is accepted.
- Validation never raises anything but ``BadArguments``/``UnknownTool``.
"""

from __future__ import annotations

from typing import Any, Final

from sandbox_worker.api import IDEMPOTENT_TOOLS, READ_ONLY_TOOLS, TOOL_NAMES, ToolSchema
from sandbox_worker.sandbox.errors import BadArguments, UnknownTool

MAX_PATH_CHARS: Final = 4096
MAX_COMMAND_CHARS: Final = 256 * 1024
MAX_ARGV_ITEMS: Final = 4096

_PATH = {"type": "string", "description": "Path relative to the workspace root. "
         "Absolute paths, '..' and symlinks are refused.", "maxLength": MAX_PATH_CHARS}

_PARAMETERS: Final[dict[str, dict[str, Any]]] = {
    "shell": {
        "type": "object",
        "properties": {
            "command": {
                "description": "A bash command line (run with bash -c), or an argv list.",
                "oneOf": [{"type": "string", "maxLength": MAX_COMMAND_CHARS},
                          {"type": "array", "items": {"type": "string"}, "minItems": 1,
                           "maxItems": MAX_ARGV_ITEMS}],
            },
            "workdir": {**_PATH, "description": "Working directory relative to the "
                        "workspace (default: the workspace root)."},
            "timeout_s": {"type": "number", "exclusiveMinimum": 0,
                          "description": "Wall-clock limit in seconds (capped by policy)."},
        },
        "required": ["command"],
        "additionalProperties": False,
    },
    "read_file": {
        "type": "object",
        "properties": {
            "path": _PATH,
            "offset": {"type": "integer", "minimum": 0,
                       "description": "First line to return, 0-based (default 0)."},
            "limit": {"type": "integer", "minimum": 1,
                      "description": "Maximum number of lines (default 2000)."},
        },
        "required": ["path"],
        "additionalProperties": False,
    },
    "write_file": {
        "type": "object",
        "properties": {"path": _PATH, "content": {"type": "string"}},
        "required": ["path", "content"],
        "additionalProperties": False,
    },
    "edit_file": {
        "type": "object",
        "properties": {
            "path": _PATH,
            "old": {"type": "string", "minLength": 1, "description": "Exact text to replace."},
            "new": {"type": "string", "description": "Replacement text."},
            "count": {"type": "integer", "minimum": 1, "description": "Replace this many "
                      "occurrences (required when 'old' occurs more than once)."},
        },
        "required": ["path", "old", "new"],
        "additionalProperties": False,
    },
    "list_dir": {
        "type": "object",
        "properties": {"path": {**_PATH, "description": "Directory relative to the "
                                "workspace (default: the workspace root)."}},
        "additionalProperties": False,
    },
}

_DESCRIPTIONS: Final = {
    "shell": "Run a command in the sandboxed workspace. Output streams back; "
             "stdout and stderr are capped.",
    "read_file": "Read a UTF-8 text file in the workspace, by lines.",
    "write_file": "Create or overwrite a file in the workspace (parents are created).",
    "edit_file": "Replace exact text in a workspace file; fails if the text is missing, "
                 "or ambiguous without 'count'.",
    "list_dir": "List a directory of the workspace.",
}

SCHEMAS: Final[list[ToolSchema]] = [
    ToolSchema(name=name, description=_DESCRIPTIONS[name], parameters=_PARAMETERS[name],
               idempotent=name in IDEMPOTENT_TOOLS, read_only=name in READ_ONLY_TOOLS)
    for name in TOOL_NAMES
]


def _type_ok(value: Any, spec: dict[str, Any]) -> bool:
    if "oneOf" in spec:
        return any(_type_ok(value, s) for s in spec["oneOf"])
    kind = spec.get("type")
    if kind == "string":
        return isinstance(value, str) and len(value) <= spec.get("maxLength", 1 << 62) \
            and len(value) >= spec.get("minLength", 0)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool) \
            and value >= spec.get("minimum", -(1 << 62))
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool) \
            and value == value and value > spec.get("exclusiveMinimum", float("-inf")) \
            and value != float("inf")
    if kind == "array":
        return isinstance(value, list) and spec.get("minItems", 0) <= len(value) \
            <= spec.get("maxItems", 1 << 62) and all(_type_ok(v, spec["items"]) for v in value)
    return False


def _describe(spec: dict[str, Any]) -> str:
    if "oneOf" in spec:
        return " or ".join(_describe(s) for s in spec["oneOf"])
    kind = str(spec.get("type"))
    if kind == "array":
        return "a non-empty list of strings"
    extra = ""
    if "minimum" in spec:
        extra = f" >= {spec['minimum']}"
    elif "exclusiveMinimum" in spec:
        extra = f" > {spec['exclusiveMinimum']}"
    elif spec.get("minLength"):
        extra = " (non-empty)"
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}{extra}"


def validate(tool: Any, arguments: Any) -> dict[str, Any]:
    """Check ``arguments`` for ``tool``; returns them, or raises a readable error."""
    if not isinstance(tool, str) or tool not in _PARAMETERS:
        raise UnknownTool(f"unknown tool {tool!r}; available: {', '.join(TOOL_NAMES)}")
    if not isinstance(arguments, dict):
        raise BadArguments(f"{tool}: arguments must be an object")
    schema = _PARAMETERS[tool]
    props: dict[str, Any] = schema["properties"]
    unknown = sorted(str(k) for k in arguments if k not in props)
    if unknown:
        raise BadArguments(f"{tool}: unknown argument(s) {', '.join(unknown)}; "
                           f"expected: {', '.join(props)}")
    missing = [k for k in schema.get("required", []) if k not in arguments]
    if missing:
        raise BadArguments(f"{tool}: missing required argument(s) {', '.join(missing)}")
    for key, value in arguments.items():
        if not _type_ok(value, props[key]):
            raise BadArguments(f"{tool}: {key!r} must be {_describe(props[key])}")
    return arguments
