"""The MCP servers a worker holds for its sessions, and the ``tool`` service's
handling of MCP requests (``ToolCallRequest.mcp``).

A stdio server runs like a shell call that lasts: the same argv chain
(``Profile.build``) with the session's workspace (pinned for the server's
life), its own uid leased from the pool for the server's life, the session's
limits, the same verification of the chain's shape by the kernel before
anything runs, and the same tree kill. In an image session (``image``) the
server runs over the image's root like the session's shell calls
(docs/images.md), with a writable layer of its own (``overlay.py``) that
lasts as long as the server's process: it is detached once the server's tree
is gone (when it exits, is killed or is stopped), and a dead worker's are
swept at the next worker's start. An HTTP server is called from the
worker (never the sandbox) with headers from the worker's environment.

Servers are keyed by (session, server name, spec digest): a session's server
keeps its state across calls. The worker also serves ``tool@PIN``
(``main.py``); every answer names it (``ToolCallResult.pin``) so the
supervisor sends the session's next calls here (docs/tools.md, "Affinity").

Invariants:
- A server that died is started again at the next call, at most
  ``RESTARTS_MAX`` times in ``RESTART_WINDOW_S`` (OTP's restart intensity);
  past that its calls get ``mcp_restart_limit`` until the window has room.
- At most ``MAX_SERVERS`` per worker; servers idle for ``IDLE_S`` (the worker's
  ``--mcp-idle-s``) are stopped, checked at each MCP request and by a sweeper
  every ``SWEEP_EVERY_S`` at most (a session that ended, on a worker no other MCP
  request reaches, leaves no server running), the least recently used first
  when full.
- Every failure is a ``ToolCallResult`` with ``is_error`` and an
  ``error_kind``; no MCP error crosses the wire as a broker failure.
- ``aclose`` stops every server and waits for the background checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from broker.worker import RequestContext
from sandbox_worker.api import (
    IsolationRecord,
    McpServerSpec,
    ToolCallResult,
    ToolLimits,
    json_text,
)
from sandbox_worker.sandbox.errors import BadArguments, ToolError
from sandbox_worker.sandbox.images import ImageRoot
from sandbox_worker.sandbox.overlay import Layer
from sandbox_worker.sandbox.profile import Profile, Shape
from sandbox_worker.tools.fsops import check_relative
from sandbox_worker.tools.mcpconn import Connection, McpFailure, env_headers, load_sdk
from sandbox_worker.tools.pinning import Pinned
from sandbox_worker.tools.shell import REPLY_MARGIN_S, _make_tmp

if TYPE_CHECKING:
    import mcp_types as types

    from sandbox_worker.sandbox.uidpool import UidLease as Lease
    from sandbox_worker.tools.service import ToolService

log = logging.getLogger(__name__)

RESTARTS_MAX: Final = 3
RESTART_WINDOW_S: Final = 60.0
MAX_SERVERS: Final = 32
IDLE_S: Final = 600.0  # the default of ToolServiceConfig.mcp_idle_s
SWEEP_EVERY_S: Final = 30.0
MIN_HIDDEN_CHARS: Final = 8  # shorter header values are not searched for in results
START_TIMEOUT_S: Final = 30.0  # a server's start, unless its spec says start_timeout_s
MAX_START_TIMEOUT_S: Final = 300.0

Key = tuple[str, str, str]  # (session id, server name, spec digest)


def start_timeout_s(spec: McpServerSpec) -> float:
    """The spec's ``start_timeout_s`` (checked by the supervisor, bounded again here:
    a request is input), else the default."""
    given = spec.get("start_timeout_s")
    if isinstance(given, int | float) and not isinstance(given, bool) \
            and 0 < given <= MAX_START_TIMEOUT_S:
        return float(given)
    return START_TIMEOUT_S


@dataclass
class Held:
    """A server and what it holds on this worker."""

    conn: Connection
    http: bool
    lease: Lease | None = None
    pinned: Pinned | None = None
    tmpdir: str | None = None
    shape: Shape | None = None
    network: bool = False
    layer: Layer | None = None  # the server's writable layer over its image's root
    last_used: float = field(default_factory=time.monotonic)


class McpHost:
    def __init__(self, service: ToolService) -> None:
        self.service = service
        self.pin = ""  # this worker's pinned service name (main.py sets it)
        self._servers: dict[Key, Held] = {}
        self._locks: dict[Key, asyncio.Lock] = {}
        self._restarts: dict[Key, deque[float]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._sweeper: asyncio.Task[None] | None = None

    @property
    def idle_s(self) -> float:
        return self.service.config.mcp_idle_s

    async def _sweep_loop(self) -> None:
        """Stop idle servers even when no MCP request comes (``_sweep`` runs at
        each request too); ends when no server is left, and the next start
        starts it again."""
        every = min(SWEEP_EVERY_S, max(0.1, self.idle_s / 4))
        while self._servers:
            await asyncio.sleep(every)
            self._sweep()

    def _ensure_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.ensure_future(self._sweep_loop())

    def info(self) -> dict[str, Any]:
        return {"servers": len(self._servers), "pin": self.pin}

    def _spawn(self, aw: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(aw)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        held = list(self._servers.values())
        self._servers.clear()
        for h in held:
            await self._stop(h)
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=10.0)

    # -- the handler --------------------------------------------------------
    async def handle(self, ctx: RequestContext, req: dict[str, Any], profile: Profile,
                     limits: ToolLimits, network: bool, start: float, *, read_only: bool,
                     git_writable: bool, image: ImageRoot | None = None) -> ToolCallResult:
        """One MCP request; ``image`` is the session's image, verified on disk
        for this call (a stdio server then runs over its root)."""
        call = req["mcp"]
        if not isinstance(call, dict) or not isinstance(call.get("server"), str) \
                or not isinstance(call.get("spec"), dict) \
                or call.get("op") not in ("list", "call") or not isinstance(call.get("tool"), str):
            raise BadArguments("mcp must be {server, spec, op: list|call, tool}")
        spec: McpServerSpec = call["spec"]
        name = call["server"]
        digest = hashlib.sha256(json_text([spec, req["workspace"], read_only, git_writable,
                                           limits, image.digest if image else None],
                                          sort_keys=True)[0].encode()).hexdigest()
        key: Key = (req["session_id"], name, digest[:16])
        self._sweep()
        # An HTTP server's header values: whatever it echoes (a result, an error,
        # its tools' descriptions) reaches no result with them in it.
        hidden = [v for v in env_headers(dict(spec.get("headers_env") or {}))[0].values()
                  if len(v) >= MIN_HIDDEN_CHARS] if "url" in spec else []
        result = await self._handle(ctx, req, call, spec, name, key, profile, limits, start,
                                    read_only=read_only, git_writable=git_writable,
                                    image=image)
        if hidden:
            result = _hide(result, hidden)
        return result

    async def _handle(self, ctx: RequestContext, req: dict[str, Any], call: dict[str, Any],
                      spec: McpServerSpec, name: str, key: Key, profile: Profile,
                      limits: ToolLimits, start: float, *, read_only: bool,
                      git_writable: bool, image: ImageRoot | None) -> ToolCallResult:
        held: Held | None = None
        try:
            held = await self._server(key, req, spec, profile, limits, ctx.budget_s(),
                                      read_only=read_only, git_writable=git_writable,
                                      image=image)
            held.last_used = time.monotonic()
            if call["op"] == "list":
                output = f"{len(held.conn.tools)} tools"
                result = self._result(req, "ok", output, held, profile, limits, start,
                                      read_only, git_writable, image)
                result["mcp_tools"] = held.conn.tools
                return result
            arguments = req["arguments"]
            if not isinstance(arguments, dict):
                raise BadArguments("an MCP tool's arguments must be a JSON object")
            left = ctx.budget_s() - REPLY_MARGIN_S
            answer = await held.conn.call(call["tool"], arguments, max(0.05, left), self._spawn)
            held.last_used = time.monotonic()
            output, is_error = render(answer)
            result = self._result(req, "error" if is_error else "ok", output, held, profile,
                                  limits, start, read_only, git_writable, image)
            if is_error:
                result["error_kind"] = "tool_error"
            return result
        except ToolError as exc:
            out = self._result(req, "timeout" if exc.kind == "timeout" else "error", str(exc),
                               held, profile, limits, start, read_only, git_writable, image)
            out["error_kind"] = exc.kind
            return out

    def _result(self, req: dict[str, Any], outcome: str, output: str, held: Held | None,
                profile: Profile, limits: ToolLimits, start: float, read_only: bool,
                git_writable: bool, image: ImageRoot | None = None) -> ToolCallResult:
        result = ToolCallResult(
            call_id=req["call_id"], tool=req["tool"], outcome=outcome,  # type: ignore[typeddict-item]
            is_error=outcome != "ok", output=output, exit_code=None, signal=None,
            duration_s=time.monotonic() - start, stdout_bytes=len(output.encode("utf-8",
                                                                                "replace")),
            stderr_bytes=0, truncated=False,
            isolation=self._isolation(held, profile, limits, read_only, git_writable, image))
        if self.pin:
            result["pin"] = self.pin
        return result

    def _isolation(self, held: Held | None, profile: Profile, limits: ToolLimits,
                   read_only: bool, git_writable: bool,
                   image: ImageRoot | None = None) -> IsolationRecord:
        if held is not None and held.http:
            # Nothing of it ran here: the worker called a remote server.
            return IsolationRecord(
                tier="T0", filesystem="remote", network="host", pid_namespace=False,
                seccomp=False, uid=os.getuid(), limits=ToolLimits(), unsandboxed_opt_in=False,
                degraded=["a streamable-HTTP MCP server, called from the worker over the "
                          "network: it runs elsewhere, in no sandbox of ours"], kernel=None)
        if held is None or held.lease is None:
            return profile.isolation(limits, network=False, uid=profile.user.uid,
                                     read_only=read_only, git_writable=git_writable,
                                     image=image)
        record = profile.isolation(limits, network=held.network, uid=held.lease.uid,
                                   shape=held.shape, read_only=read_only,
                                   git_writable=git_writable,
                                   gid=held.pinned.gid if held.pinned else None, image=image)
        if "image" in record:  # the server's layer, kept across its calls
            record["image"]["writable_layer"] = "per-server"
        return record

    # -- servers ------------------------------------------------------------
    def _sweep(self) -> None:
        now = time.monotonic()
        idle = sorted((h.last_used, k) for k, h in self._servers.items()
                      if h.conn.in_flight == 0)
        over = len(self._servers) - MAX_SERVERS + 1
        for i, (used, key) in enumerate(idle):
            if now - used > self.idle_s or i < over:
                self._spawn(self._stop(self._servers.pop(key)))
        # The bookkeeping of servers no longer held is bounded too.
        for key in [k for k in self._locks if k not in self._servers
                    and not self._locks[k].locked()]:
            del self._locks[key]
        for key in [k for k, t in self._restarts.items() if k not in self._servers
                    and (not t or now - t[-1] > RESTART_WINDOW_S)]:
            del self._restarts[key]

    async def _server(self, key: Key, req: dict[str, Any], spec: McpServerSpec,
                      profile: Profile, limits: ToolLimits, budget_s: float, *,
                      read_only: bool, git_writable: bool,
                      image: ImageRoot | None) -> Held:
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            held = self._servers.get(key)
            if held is not None and not held.conn.dead.is_set() and held.conn.failure is None:
                return held
            if held is not None:  # died since its last call: restart, bounded
                self._servers.pop(key, None)
                await self._stop(held)
                times = self._restarts.setdefault(key, deque())
                now = time.monotonic()
                while times and now - times[0] > RESTART_WINDOW_S:
                    times.popleft()
                if len(times) >= RESTARTS_MAX:
                    self._servers[key] = held  # keeps failing until the window has room
                    raise McpFailure(
                        f"MCP server {key[1]!r} stopped {len(times) + 1} times within "
                        f"{RESTART_WINDOW_S:g} s; it is not restarted before "
                        f"{RESTART_WINDOW_S - (now - times[0]):.0f} s from now. Last: "
                        f"{held.conn.failure or 'it stopped'}", kind="mcp_restart_limit")
                times.append(now)
            # A start that fails must still be stopped (grace_s) and answered
            # within the call's budget.
            room = budget_s - REPLY_MARGIN_S - self.service.config.grace_s - 0.5
            held = await self._start(key, req, spec, profile, limits,
                                     max(0.05, min(start_timeout_s(spec), room)),
                                     read_only=read_only, git_writable=git_writable,
                                     image=image)
            self._servers[key] = held
            self._ensure_sweeper()
            return held

    async def _start(self, key: Key, req: dict[str, Any], spec: McpServerSpec,
                     profile: Profile, limits: ToolLimits, timeout_s: float, *,
                     read_only: bool, git_writable: bool, image: ImageRoot | None) -> Held:
        name = key[1]
        deadline = time.monotonic() + timeout_s
        await load_sdk()  # seconds the first time on a loaded machine: not on the loop
        conn = Connection(name)
        if "url" in spec:
            headers, missing = env_headers(dict(spec.get("headers_env", {})))
            if missing:
                raise McpFailure(f"MCP server {name!r}: the worker's environment lacks "
                                 f"{', '.join(sorted(missing))}", kind="mcp_start_failed")
            conn.start_http(str(spec["url"]), headers)
            held = Held(conn, http=True)
        else:
            held = await self._start_stdio(conn, req, spec, profile, limits, timeout_s,
                                           read_only=read_only, git_writable=git_writable,
                                           image=image)
        try:
            await conn.wait_ready(max(0.05, deadline - time.monotonic()), timeout_s)
        except McpFailure as exc:
            await asyncio.shield(self._stop(held))
            raise McpFailure(f"{exc} (the server did not start)",
                             kind="mcp_start_failed") from None
        except BaseException:
            await asyncio.shield(self._stop(held))
            raise
        log.info("MCP server %r of session %s started (%d tools)", name, key[0],
                 len(conn.tools))
        return held

    async def _start_stdio(self, conn: Connection, req: dict[str, Any], spec: McpServerSpec,
                           profile: Profile, limits: ToolLimits, timeout_s: float, *,
                           read_only: bool, git_writable: bool,
                           image: ImageRoot | None) -> Held:
        svc = self.service
        pool, pins = svc.pool, svc.pins
        if pool is None or pins is None:
            raise McpFailure("the tool service is not started", kind="internal")
        argv = spec.get("command")
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise BadArguments("mcp spec: command must be a non-empty list of strings")
        env = spec.get("env") or {}
        if env:  # the chain clears the environment; the server's own comes last
            argv = ["/usr/bin/env", "--", *(f"{k}={v}" for k, v in env.items()), *argv]
        workdir = check_relative(str(spec.get("cwd", ".")))
        network = spec.get("network", False) is True
        held = Held(conn, http=False, network=network)
        try:
            held.lease = await pool.acquire(timeout_s=max(0.0, timeout_s - 1.0))
            held.pinned = await pins.open(req["workspace"], req["session_id"],
                                          req.get("workspace_identity"), shell=True,
                                          git_writable=git_writable or read_only,
                                          host=req.get("workspace_host"))
            uid, pinned = held.lease.uid, held.pinned
            if profile.tier in ("T1", "T0"):
                held.tmpdir = await asyncio.to_thread(_make_tmp, profile, uid)
            ro_fds = tuple(pinned.git_fds)
            if image is not None:  # the server's own layer over the image (overlay.py)
                try:
                    held.layer = await profile.image_layer(image, limits, uid, pinned.gid)
                except OSError as exc:
                    raise ToolError(f"the image's root could not be mounted for MCP server "
                                    f"{conn.name!r}: {exc}", kind="sandbox_unavailable") from None
            chain = profile.build(argv, pinned.path, limits, network=network, uid=uid,
                                  tmpdir=held.tmpdir, call_id=f"mcp-{conn.name}",
                                  workdir=workdir, workspace_fd=pinned.fd, gid=pinned.gid,
                                  read_only=read_only, ro_fds=ro_fds, image=image,
                                  layer=held.layer)
            try:
                verified = profile.verified.get(chain.shape)
                if verified is None:
                    shape, verified = await profile.verify_chain(
                        pinned.path, network=network, uid=uid, tmpdir=held.tmpdir,
                        workdir=workdir, workspace_fd=pinned.fd, gid=pinned.gid,
                        read_only=read_only, ro_fds=ro_fds, image=image)
                    if shape != chain.shape:
                        raise ToolError("the server's sandbox chain differs from the one "
                                        "probed for it", kind="sandbox_unavailable")
                if verified.problems:
                    raise ToolError(f"the server's sandbox did not hold at tier "
                                    f"{profile.tier}: {'; '.join(verified.problems)}",
                                    kind="sandbox_unavailable")
                held.shape = chain.shape
                await conn.start_stdio(chain.argv, chain.env, chain.pass_fds, uid,
                                       svc.config.grace_s)
            finally:
                for fd in chain.pass_fds:
                    os.close(fd)
            if held.layer is not None:
                self._spawn(self._drop_layer_when_dead(held))
        except OSError as exc:
            await asyncio.shield(self._stop(held))
            raise McpFailure(f"MCP server {conn.name!r} could not be started: {exc}",
                             kind="mcp_start_failed") from None
        except BaseException:
            await asyncio.shield(self._stop(held))
            raise
        return held

    async def _stop(self, held: Held) -> None:
        """Stop the server and give back what it held (bounded; never raises)."""
        try:
            await held.conn.close()
        except Exception:
            log.exception("MCP server %r did not stop cleanly", held.conn.name)
        pins, pool = self.service.pins, self.service.pool
        if held.pinned is not None:
            if pins is not None:
                await asyncio.shield(pins.release(held.pinned))
            else:
                held.pinned.close()
            held.pinned = None
        if held.lease is not None and pool is not None:
            await pool.give_back(held.lease)
            held.lease = None
        if held.tmpdir is not None:
            await asyncio.to_thread(shutil.rmtree, held.tmpdir, True)
            held.tmpdir = None
        await self._drop_layer(held)

    async def _drop_layer_when_dead(self, held: Held) -> None:
        """A server over an image that exits or is killed between calls gives
        its layer back then, not at its next call (its tree is gone once
        ``dead`` is set: ``Connection._run_stdio`` kills it first)."""
        await held.conn.dead.wait()
        await self._drop_layer(held)

    @staticmethod
    async def _drop_layer(held: Held) -> None:
        layer, held.layer = held.layer, None
        if layer is not None:
            await asyncio.shield(asyncio.to_thread(layer.close))


def _hide(value: Any, hidden: list[str]) -> Any:
    """``value`` (a result: dicts, lists, strings) with each of ``hidden`` replaced."""
    if isinstance(value, str):
        for secret in hidden:
            value = value.replace(secret, "[REDACTED]")
        return value
    if isinstance(value, dict):
        return {k: _hide(v, hidden) for k, v in value.items()}
    if isinstance(value, list):
        return [_hide(v, hidden) for v in value]
    return value


def render(result: types.CallToolResult) -> tuple[str, bool]:
    """What the model reads of a tool result: its text parts; other parts
    named with their size; structured content as JSON when there is no text."""
    import mcp_types as types

    parts: list[str] = []
    for item in result.content or []:
        if isinstance(item, types.TextContent):
            parts.append(item.text)
        else:
            kind = getattr(item, "type", "content")
            mime = getattr(item, "mime_type", None) or ""
            data = getattr(item, "data", None)
            size = f", {len(data)} base64 characters" if isinstance(data, str) else ""
            parts.append(f"[{kind} {mime}{size}]".replace(" ]", "]"))
    if not parts and result.structured_content is not None:
        with contextlib.suppress(TypeError, ValueError):
            parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    text = "\n".join(parts) or "[no output]"
    return text, bool(result.is_error)
