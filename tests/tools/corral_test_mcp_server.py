"""A small MCP server for the tests, made with the SDK's server API
(``MCPServer``). Run as ``python3 -m corral_test_mcp_server [MODE]`` inside
the sandbox (the tests copy it next to the SDK, see conftest.py).

MODE ``ok`` (default) serves the tools below; ``garbage`` prints a line that
is not JSON-RPC on stdout first; ``noinit`` reads stdin and never answers;
``fail`` writes to stderr and exits 1; ``badschema`` declares one tool with an
invalid input schema; ``http`` serves streamable HTTP on 127.0.0.1 port 0,
prints ``{"port": N}`` and answers only requests whose ``X-Corral-Token``
header is present (401 otherwise), and tool ``token`` says how long it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading

from mcp.server.mcpserver import MCPServer
from mcp_types import ToolAnnotations

server = MCPServer("corral-test")
state = {"total": 0, "cancelled": 0}


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
    """Sleep (cooperatively: notifications/cancelled ends it, and is counted).
    Leaves ``sleeping`` in its cwd first: the tests' proof the call arrived."""
    _mark("sleeping")
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        state["cancelled"] += 1
        raise
    return "slept"


@server.tool()
def flood(n: int) -> str:
    """Write n notifications the client cannot validate (a progress notification
    without its fields) on the wire before answering: a hostile server's flood."""
    from mcp.server import stdio

    fd = stdio._claims[1].private_fd  # the wire (the SDK diverts fd 1 to stderr)
    assert fd is not None
    line = b'{"jsonrpc":"2.0","method":"notifications/progress","params":{}}\n'
    data = memoryview(line * n)
    while data:
        data = data[os.write(fd, data):]
    return "flooded"


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
async def peek(seconds: float) -> str:
    """Read-only: the first call in a workspace leaves ``peeking`` and sleeps;
    any later one (a re-run) answers at once."""
    if not _first("peeking"):
        return "peeked again"
    await asyncio.sleep(seconds)
    return "peeked"


def _first(name: str) -> bool:
    """Leave ``name`` in the cwd; whether it was not there yet."""
    if os.path.exists(name):
        return False
    _mark(name)
    return True


def _mark(name: str) -> None:
    with contextlib.suppress(OSError), open(name, "w") as f:
        f.write(str(os.getpid()))


@server.tool()
def cancelled() -> str:
    """How many sleep calls were cancelled by the client."""
    return str(state["cancelled"])


@server.tool()
async def hang() -> str:
    """Block the server's event loop (it answers nothing, not even a ping)."""
    threading.Event().wait()
    return "never"


@server.tool()
def big(n_bytes: int) -> str:
    """Return n_bytes characters."""
    return "x" * n_bytes


@server.tool()
def daemon() -> str:
    """Leave a double-forked, session-leading daemon that ignores SIGTERM and
    SIGHUP and waits until killed (what must not outlive the server's worker)."""
    import signal

    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            while True:  # until killed: TERM and HUP are ignored, so only KILL ends it
                signal.pause()
        os._exit(0)
    return f"daemon left by {os.getpid()}"


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


def serve_http() -> None:
    import json
    import socket

    import uvicorn

    seen = {"token": ""}

    @server.tool()
    def token() -> str:
        """The length of the X-Corral-Token header the client sent."""
        return str(len(seen["token"]))

    @server.tool()
    def echo_token() -> str:
        """The X-Corral-Token header the client sent, as is (a hostile server)."""
        return f"you sent {seen['token']}"

    @server.tool()
    def fail_token() -> str:
        """A JSON-RPC error whose message holds the header (a hostile server)."""
        from mcp.shared.exceptions import MCPError

        raise MCPError(-32000, f"bad token {seen['token']}")

    app = server.streamable_http_app(host="127.0.0.1")

    async def guarded(scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            value = headers.get(b"x-corral-token", b"").decode()
            if not value:
                await send({"type": "http.response.start", "status": 401,  # type: ignore[operator]
                            "headers": [(b"content-type", b"text/plain")]})
                await send({"type": "http.response.body", "body": b"no token"})  # type: ignore[operator]
                return
            seen["token"] = value
        await app(scope, receive, send)  # type: ignore[arg-type]

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)  # before the port is said: a client may connect at once
    sys.stdout.write(json.dumps({"port": sock.getsockname()[1]}) + "\n")
    sys.stdout.flush()
    config = uvicorn.Config(guarded, log_level="warning", lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
    if mode == "http":
        serve_http()
        return
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
