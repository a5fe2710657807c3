"""A small MCP server for the tests, made with the SDK's server API
(``MCPServer``). Run as ``python3 -m corral_test_mcp_server [MODE]`` inside
the sandbox (the tests copy it next to the SDK, see conftest.py).

MODE ``ok`` (default) serves the tools below; ``garbage`` prints a line that
is not JSON-RPC on stdout first; ``noinit`` reads stdin and never answers;
``fail`` writes to stderr and exits 1; ``badschema`` declares one tool with an
invalid input schema.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

from mcp.server.mcpserver import MCPServer
from mcp_types import ToolAnnotations

server = MCPServer("corral-test")
state = {"total": 0}


@server.tool(annotations=ToolAnnotations(read_only_hint=False, idempotent_hint=False))
def add(n: int) -> str:
    """Add n to the running total and return it (state kept across calls)."""
    state["total"] += n
    return str(state["total"])


@server.tool(annotations=ToolAnnotations(read_only_hint=True, idempotent_hint=True))
def whoami() -> str:
    """Where the server runs: uid, cwd, pid, and the files of its cwd."""
    return f"uid={os.getuid()} cwd={os.getcwd()} pid={os.getpid()} files={sorted(os.listdir('.'))}"


@server.tool()
async def sleep(seconds: float) -> str:
    """Sleep (cooperatively: a cancel ends it)."""
    await asyncio.sleep(seconds)
    return "slept"


@server.tool()
async def hang() -> str:
    """Block the server's event loop (it answers nothing, not even a ping)."""
    time.sleep(3600)  # noqa: ASYNC251 -- blocking on purpose
    return "never"


@server.tool()
def big(n_bytes: int) -> str:
    """Return n_bytes characters."""
    return "x" * n_bytes


@server.tool()
def crash() -> str:
    """Exit the server process at once."""
    os._exit(3)


@server.tool()
def write(path: str, text: str) -> str:
    """Write a file in the current directory."""
    with open(path, "w") as f:
        f.write(text)
    return "written"


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
    if mode == "garbage":
        sys.stdout.write("hello, this is not JSON-RPC\n")
        sys.stdout.flush()
    elif mode == "noinit":
        for _ in sys.stdin:
            pass
        return
    elif mode == "fail":
        sys.stderr.write("starting corral-test\nerror: the database is missing\n")
        sys.exit(1)
    elif mode == "badschema":
        tool = server._tool_manager.get_tool("big")
        assert tool is not None
        tool.parameters = {"type": "object", "properties": {"n_bytes": {"type": "integr"}}}
    server.run("stdio")


if __name__ == "__main__":
    main()
