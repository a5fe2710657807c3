"""Command tools (``[tools.NAME]``): the worker's side of the calling
convention. The supervisor has validated the arguments against the tool's
declared schema already; here the request is checked as data once more (it
crossed a process boundary) and turned into the argv and stdin of a call that
runs exactly like a shell call (``service._shell``): same sandbox chain,
per-call uid, limits, output bounds, tree kill and isolation record.

Invariants:
- The argv is the spec's list as given: no shell parses it.
- stdin is the arguments as one compact JSON document, then closed; a command
  that reads none of it is not an error (``process._feed``).
"""

from __future__ import annotations

import json
from typing import Any, Final

from sandbox_worker.api import json_text
from sandbox_worker.sandbox.errors import BadArguments

MAX_STDIN_BYTES: Final = 1 << 20


def command_call(spec: Any, arguments: Any) -> tuple[list[str], bytes]:
    """(argv, stdin) of a command tool call; ``BadArguments`` when either is
    not what the supervisor sends."""
    if not isinstance(spec, dict):
        raise BadArguments("command_tool must be an object")
    argv = spec.get("command")
    if not isinstance(argv, list) or not argv or not all(
            isinstance(a, str) and a and "\0" not in a for a in argv):
        raise BadArguments("command_tool.command must be a non-empty list of strings")
    if not isinstance(arguments, dict):
        raise BadArguments("a command tool's arguments must be a JSON object")
    try:
        text, size = json_text(arguments)
    except (TypeError, ValueError) as exc:
        raise BadArguments(f"the arguments are not JSON: {exc}") from None
    if size > MAX_STDIN_BYTES:
        raise BadArguments(f"the arguments are {size} bytes; at most {MAX_STDIN_BYTES}")
    json.loads(text)  # what the command reads parses (surrogates were escaped)
    return list(argv), (text + "\n").encode("utf-8")
