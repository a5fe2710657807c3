"""One MCP server connection, with the official ``mcp`` SDK's ``ClientSession``
as the client: a stdio server started inside the call's sandbox chain, or a
streamable-HTTP server called from the worker.

A ``Connection`` owns one runner task that holds the SDK session's context
(its task group lives and ends in that one task) and, for stdio, the server's
process and the three pipe pumps. ``call`` and ``list_tools`` are used from the
tool service's handler tasks.

The stdio transport is ours (the SDK's ``stdio_client`` spawns without our
sandbox chain, keeps stderr nowhere and reads lines of any length); messages
are still parsed and framed by the SDK (``jsonrpc_message_adapter``,
``SessionMessage``): no JSON-RPC is written by hand.

Invariants:
- Every wait has a deadline; a server that does not answer ``initialize`` or
  a call in time gets a ``McpFailure`` (kind ``timeout``) and, when it does not
  answer a ping either, is killed (``kill``).
- Strict stdout: a line that is not a JSON-RPC message, or one over
  ``MAX_MESSAGE_BYTES``, ends the server with kind ``protocol`` /
  ``output_limit`` (the MCP spec forbids anything else on stdout, and a stream
  cannot be resynchronised). Nothing read is kept beyond one message.
- What the SDK logs about a server's messages is bounded (``BoundedLog``: at
  most ``LOG_BURST`` records of one line per ``LOG_WINDOW_S``): a server's
  flood of messages the SDK cannot validate does not flood the worker's log.
- stderr keeps its last ``STDERR_LINES`` lines (each clipped): what a failure
  names.
- ``close`` (and a death) leaves no process of the server: ``process.kill_tree``
  ends its tree by head and by uid, then the process is reaped.
- Credentials of an HTTP server come from the worker's environment by name and
  are held only in the httpx client's headers: never logged, never returned.
- The SDK (pydantic and all) is imported at a server's first start, never at
  the worker's, and in a thread (``load_sdk``): it costs seconds on a loaded
  machine, which neither a worker's readiness nor its event loop (its
  heartbeats) may wait for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final

from sandbox_worker.api import MCP_HEADER_ENV_PREFIX, McpToolInfo
from sandbox_worker.sandbox.errors import ToolError
from sandbox_worker.sandbox.process import kill_tree
from sandbox_worker.sandbox.reaper import MANAGED_HEADS, spawning

if TYPE_CHECKING:
    import mcp_types as types
    from mcp.client.session import ClientSession

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES: Final = 4 << 20  # one JSON-RPC line from a server
STDERR_LINES: Final = 20
STDERR_LINE_CHARS: Final = 400
MAX_TOOL_PAGES: Final = 20
MAX_TOOLS: Final = 256
PING_GRACE_S: Final = 1.0
LOG_BURST: Final = 10  # records of one SDK log line per window (BoundedLog)
LOG_WINDOW_S: Final = 60.0


class BoundedLog(logging.Filter):
    """At most ``LOG_BURST`` records of one logger and message template per
    ``LOG_WINDOW_S``; the first record of the next window says how many were
    left out. The SDK logs a warning, with its traceback, for each message of
    a server it cannot validate: 1.3 KB of log per 65-byte line, 26 MB for a
    server's 20,000 bad notifications (measured), so a hostile server could
    fill the worker's log as fast as it writes."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: dict[tuple[str, str], tuple[float, int, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        now = time.monotonic()
        start, count, dropped = self._seen.get(key, (now, 0, 0))
        if now - start > LOG_WINDOW_S:
            if dropped:
                record.msg = (f"{record.msg} (and {dropped} more like it in "
                              f"{LOG_WINDOW_S:g} s, not logged)")
            start, count, dropped = now, 0, 0
        if count >= LOG_BURST:
            self._seen[key] = (start, count, dropped + 1)
            return False
        if len(self._seen) >= 1024 and key not in self._seen:
            self._seen.clear()  # bounded: many templates start over
        self._seen[key] = (start, count + 1, dropped)
        return True


_BOUNDED = BoundedLog()


def _import_sdk() -> None:
    import anyio  # noqa: F401
    import httpx2  # noqa: F401
    import mcp_types  # noqa: F401
    from mcp.client import session, streamable_http  # noqa: F401
    from mcp.shared import message  # noqa: F401

    # Every logger of the SDK's modules (made at their import, above) is bounded;
    # found by module, not by name: the client session's logger is named "client".
    loggers = [logger for name, mod in list(sys.modules.items())
               if name.split(".")[0] in ("mcp", "mcp_types") and mod is not None
               for logger in list(vars(mod).values()) if isinstance(logger, logging.Logger)]
    loggers += [logger for name, logger in list(logging.Logger.manager.loggerDict.items())
                if name.split(".")[0] in ("mcp", "mcp_types")
                and isinstance(logger, logging.Logger)]
    for logger in loggers:
        if _BOUNDED not in logger.filters:
            logger.addFilter(_BOUNDED)


async def load_sdk() -> None:
    """Import the SDK off the event loop (once; later calls return at once).
    Every use of the SDK in this module comes after this."""
    await asyncio.to_thread(_import_sdk)


class McpFailure(ToolError):
    """A server that failed: kinds ``mcp_start_failed``, ``timeout``,
    ``protocol``, ``output_limit``, ``mcp_server_died``, ``mcp_restart_limit``,
    ``mcp_error``."""


class Connection:
    """One live (or starting, or dead) server connection."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.session: ClientSession | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self.uid: int | None = None
        self.grace_s = 2.0
        self.stderr: deque[str] = deque(maxlen=STDERR_LINES)
        self.failure: McpFailure | None = None
        self.dead = asyncio.Event()
        self.ready = asyncio.Event()
        self._stop = asyncio.Event()
        self.runner: asyncio.Task[None] | None = None
        self.tools: list[McpToolInfo] = []
        self.in_flight = 0
        self._with_stderr = False

    # -- life ---------------------------------------------------------------
    def fail(self, kind: str, message: str, *, stderr: bool = False) -> None:
        """Record the first failure and stop the server; with ``stderr`` its
        message ends with the stderr tail as it is when the failure is read."""
        if self.failure is None:
            self.failure = McpFailure(message, kind=kind)
            self._with_stderr = stderr
        self._stop.set()

    def stderr_tail(self) -> str:
        if not self.stderr:
            return "its stderr was empty"
        return "its stderr's last lines:\n" + "\n".join(self.stderr)

    async def start_stdio(self, argv: list[str], env: dict[str, str], pass_fds: list[int],
                          uid: int, grace_s: float) -> None:
        """Spawn the chain and start the runner; returns once it runs (not
        yet initialized: ``wait_ready``)."""
        self.uid, self.grace_s = uid, grace_s
        with spawning():
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=env, pass_fds=tuple(pass_fds),
                start_new_session=True, close_fds=True, limit=MAX_MESSAGE_BYTES)
            MANAGED_HEADS.add(proc.pid)
        self.proc = proc
        self.runner = asyncio.ensure_future(self._run_stdio(proc))

    def start_http(self, url: str, headers: dict[str, str]) -> None:
        self.runner = asyncio.ensure_future(self._run_http(url, headers))

    async def wait_ready(self, timeout_s: float, start_s: float | None = None) -> None:
        """Initialize (the SDK's handshake) and list the tools, within ``timeout_s``
        (what is left of the server's whole start, ``start_s``, which the error names)."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._race(self.ready.wait())
                session = self.session
                if session is None:
                    raise self._died()
                await self._race(session.initialize())
                self.tools = await self._race(self._list_tools(session))
        except TimeoutError:
            self.fail("timeout", f"MCP server {self.name!r} did not answer initialize and "
                      f"tools/list within {start_s or timeout_s:.3g} s (its start timeout; "
                      "start_timeout_s in its spec sets it)", stderr=True)
            raise self._died() from None
        except McpFailure:
            raise
        except Exception as exc:  # the SDK's errors: a refused handshake, a bad answer
            self.fail("mcp_start_failed", f"MCP server {self.name!r} failed to start: "
                      f"{_text(exc)}", stderr=True)
            raise self._died() from None

    async def close(self) -> None:
        """Stop the server (bounded) and wait for the runner's end."""
        self._stop.set()
        if self.runner is not None:
            await asyncio.shield(asyncio.wait({self.runner}))

    def _died(self) -> McpFailure:
        if self.failure is not None:
            if self._with_stderr:
                return McpFailure(f"{self.failure}; {self.stderr_tail()}",
                                  kind=self.failure.kind)
            return self.failure
        return McpFailure(f"MCP server {self.name!r} stopped; {self.stderr_tail()}",
                          kind="mcp_server_died")

    async def _race(self, aw: Awaitable[Any]) -> Any:
        """``aw``, unless the server dies first (then its failure)."""
        task = asyncio.ensure_future(aw)
        dead = asyncio.ensure_future(self.dead.wait())
        try:
            await asyncio.wait({task, dead}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            dead.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        if task.done() and not task.cancelled():
            return task.result()
        raise self._died()

    # -- calls --------------------------------------------------------------
    async def call(self, tool: str, arguments: dict[str, Any], timeout_s: float,
                   spawn: Callable[[Awaitable[None]], None]) -> types.CallToolResult:
        """Call ``tool``; on a timeout or a cancel the SDK sends
        ``notifications/cancelled``, and a server that then does not answer a
        ping within ``PING_GRACE_S`` is killed (``spawn`` owns that check)."""
        session = self.session
        if session is None or self.dead.is_set():
            raise self._died()
        self.in_flight += 1
        try:
            async with asyncio.timeout(timeout_s):
                result = await self._race(session.call_tool(tool, arguments))
        except TimeoutError:
            spawn(self.check_alive())
            raise McpFailure(f"MCP tool {tool!r} of server {self.name!r} did not answer "
                             f"within {timeout_s:g} s (cancelled)", kind="timeout") from None
        except asyncio.CancelledError:
            spawn(self.check_alive())
            raise
        except McpFailure:
            raise
        except Exception as exc:  # an error answer (MCPError), a result of the wrong shape
            if self.failure is None and not self.dead.is_set() and _connection_lost(exc):
                # The SDK's transport gave up (an HTTP server killed or
                # restarted, a dropped stream): this session is unusable, so
                # the next call must start a new one (restart intensity).
                self.fail("mcp_server_died", f"MCP server {self.name!r} lost the "
                          f"connection during tool {tool!r}: {_text(exc)}")
            if self.failure is not None or self.dead.is_set():
                await self.close()  # the server is gone when the call answers
                raise self._died() from None  # the connection ended: say why
            raise McpFailure(f"MCP server {self.name!r} answered tool {tool!r} with an "
                             f"error: {_text(exc)}", kind="mcp_error") from None
        finally:
            self.in_flight -= 1
        import mcp_types as types

        if not isinstance(result, types.CallToolResult):
            raise McpFailure(f"MCP server {self.name!r} answered tool {tool!r} with no tool "
                             "result", kind="protocol")
        return result

    async def check_alive(self) -> None:
        """After an abandoned call: a server that does not answer a ping in
        ``PING_GRACE_S`` is hung and is killed (its tree, by ``close``)."""
        session = self.session
        if session is None or self.dead.is_set():
            return
        try:
            async with asyncio.timeout(PING_GRACE_S):
                await self._race(session.send_ping())
        except (TimeoutError, McpFailure, Exception):  # any: not alive
            self.fail("timeout", f"MCP server {self.name!r} did not answer a ping after a "
                      "cancelled call; it was killed")
            await self.close()

    async def _list_tools(self, session: ClientSession) -> list[McpToolInfo]:
        import mcp_types as types

        out: list[McpToolInfo] = []
        cursor: str | None = None
        for _ in range(MAX_TOOL_PAGES):
            params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
            page = await session.list_tools(params=params)
            for tool in page.tools:
                ann = tool.annotations
                schema = tool.input_schema
                out.append(McpToolInfo(
                    name=str(tool.name), description=str(tool.description or "")[:4096],
                    input_schema=dict(schema) if isinstance(schema, dict) else {},
                    read_only=bool(ann is not None and ann.read_only_hint),
                    idempotent=bool(ann is not None and ann.idempotent_hint)))
                if len(out) >= MAX_TOOLS:
                    return out
            cursor = page.next_cursor
            if not cursor:
                break
        return out

    # -- runners ------------------------------------------------------------
    async def _run_stdio(self, proc: asyncio.subprocess.Process) -> None:
        import anyio
        from mcp.client.session import ClientSession
        from mcp.shared.message import SessionMessage

        to_session, read_stream = anyio.create_memory_object_stream[
            SessionMessage | Exception](16)
        write_stream, from_session = anyio.create_memory_object_stream[SessionMessage](16)
        try:
            async with asyncio.TaskGroup() as tg:
                pumps = [tg.create_task(self._pump_stdout(proc, to_session)),
                         tg.create_task(self._pump_stdin(proc, from_session)),
                         tg.create_task(self._pump_stderr(proc))]
                exited = tg.create_task(proc.wait())
                async with ClientSession(read_stream, write_stream) as session:
                    self.session = session
                    self.ready.set()
                    stop = tg.create_task(self._stop.wait())
                    await asyncio.wait({stop, exited}, return_when=asyncio.FIRST_COMPLETED)
                    stop.cancel()
                if proc.returncode is not None:
                    self.fail("mcp_server_died", f"MCP server {self.name!r} exited with code "
                              f"{proc.returncode}", stderr=True)
                await self._kill(proc)
                for task in pumps:
                    task.cancel()
        except Exception:
            log.exception("MCP server %r: the connection failed", self.name)
            self.fail("mcp_server_died", f"MCP server {self.name!r} connection failed")
        finally:
            self.session = None
            await asyncio.shield(self._kill(proc))
            self.dead.set()
            self.ready.set()

    async def _kill(self, proc: asyncio.subprocess.Process) -> None:
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        if proc.returncode is None or MANAGED_HEADS.__contains__(proc.pid):
            await kill_tree(proc, self.grace_s, self.uid)
            MANAGED_HEADS.discard(proc.pid)

    async def _pump_stdout(self, proc: asyncio.subprocess.Process, sink: Any) -> None:
        import anyio
        import mcp_types as types
        from mcp.shared.message import SessionMessage

        reader = proc.stdout
        if reader is None:
            return
        while True:
            try:
                line = await reader.readuntil(b"\n")
            except asyncio.IncompleteReadError as exc:
                if exc.partial.strip():
                    self.fail("protocol", f"MCP server {self.name!r} ended stdout inside a "
                              "message")
                    return
                # stdout closed: the server is ending; say how (bounded wait).
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await proc.wait()
                code = proc.returncode
                self.fail("mcp_server_died", f"MCP server {self.name!r} closed its stdout"
                          + (f" and exited with code {code}" if code is not None else ""),
                          stderr=True)
                return
            except asyncio.LimitOverrunError:
                self.fail("output_limit", f"MCP server {self.name!r} sent a message over "
                          f"{MAX_MESSAGE_BYTES} bytes; it was stopped")
                return
            if not line.strip():
                continue
            try:
                message = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
            except ValueError:
                shown = line[:200].decode("utf-8", "replace").rstrip()
                self.fail("protocol", f"MCP server {self.name!r} wrote something that is not "
                          f"JSON-RPC on stdout: {shown!r}; it was stopped")
                return
            try:
                await sink.send(SessionMessage(message))
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return

    async def _pump_stdin(self, proc: asyncio.subprocess.Process, source: Any) -> None:
        pipe = proc.stdin
        if pipe is None:
            return
        async with source:
            async for message in source:
                data = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                try:
                    pipe.write(data.encode("utf-8") + b"\n")
                    await pipe.drain()
                except (BrokenPipeError, ConnectionResetError):
                    return

    async def _pump_stderr(self, proc: asyncio.subprocess.Process) -> None:
        reader = proc.stderr
        if reader is None:
            return
        partial = b""
        while True:
            data = await reader.read(65536)
            if not data:
                if partial.strip():
                    self.stderr.append(partial.decode("utf-8", "replace")[:STDERR_LINE_CHARS])
                return
            *lines, partial = (partial + data).split(b"\n")
            partial = partial[-STDERR_LINE_CHARS * 4:]
            for line in lines:
                if line.strip():
                    self.stderr.append(line.decode("utf-8", "replace")[:STDERR_LINE_CHARS])

    async def _run_http(self, url: str, headers: dict[str, str]) -> None:
        from mcp.client.session import ClientSession
        from mcp.client.streamable_http import streamable_http_client

        try:
            import httpx2

            # No read timeout: a call is bounded by its own budget (``call``).
            # Built in a thread: its TLS context loads the CA store, 0.1-0.3 s
            # of CPU measured at load 15, which the worker's heartbeats (a
            # 1 s liveness window) must not wait behind.
            made = await asyncio.to_thread(httpx2.AsyncClient, headers=headers,
                                           timeout=httpx2.Timeout(10.0, read=None))
            async with made as client, \
                    streamable_http_client(url, http_client=client) as (read, write), \
                    ClientSession(read, write) as session:
                self.session = session
                self.ready.set()
                await self._stop.wait()
        except Exception as exc:
            # The message names the URL's host and the error, never a header.
            log.warning("MCP server %r (HTTP): %s", self.name, type(exc).__name__)
            self.fail("mcp_server_died", f"MCP server {self.name!r} (HTTP) connection "
                      f"failed: {_text(exc)}")
        finally:
            self.session = None
            self.dead.set()
            self.ready.set()


def _connection_lost(exc: BaseException) -> bool:
    """Whether the SDK's error says the session itself is gone: its transport
    closed (``CONNECTION_CLOSED``, also what it synthesises for a response
    stream that ended unanswered) or the server no longer knows the session
    (HTTP 404 on a session id: the MCP spec says start a new one)."""
    from mcp.shared.exceptions import MCPError
    from mcp_types import CONNECTION_CLOSED, INVALID_REQUEST

    if not isinstance(exc, MCPError):
        return False
    return exc.code == CONNECTION_CLOSED or (exc.code == INVALID_REQUEST
                                             and exc.message == "Session terminated")


def _text(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        text = _text(exc.exceptions[0])
    return text[:1000]


def env_headers(headers_env: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """HTTP headers from the worker's environment (``headers_env``: header ->
    variable name), and the names that are not set."""
    found: dict[str, str] = {}
    missing: list[str] = []
    for header, var in headers_env.items():
        # Checked here too: the request crossed a process boundary.
        value = os.environ.get(var) if var.startswith(MCP_HEADER_ENV_PREFIX) else None
        if value is None:
            missing.append(var)
        else:
            found[header] = value
    return found, missing
