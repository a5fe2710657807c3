"""Client tools and client hooks: Python functions of a client program that the
supervisor offers to the model (tools) or runs as middleware (hooks), reached
back over that program's own client connection (``supervisor/wire.py``).

A session declares its client tools (name, description, JSON schema) and hook
events when it is created (``client_tools``, ``client_hooks``, ``client_wait_s``
in the create spec); the declaration is part of the session's stored config,
so the tools stay offered across disconnects and supervisor restarts. A
connected client *holds* them by calling ``register_client`` for the session
(the SDK does this on connect and again after every reconnect); the last
registration of a name wins.

The rule when the holder is missing or goes away (docs/tools.md, "Client tools"):
- a new call waits for a holder at most ``client_wait_s`` (default 10 s, and
  never past the call's budget), then fails with kind ``client_unavailable``
  (not retried, the model reads it); a message that cannot be sent counts the
  same, since the call never reached the program;
- a call in flight when its holder is dropped (silent for its liveness window)
  ends ``unknown`` (kind ``worker_lost``: the program may or may not have run
  it) and is never re-run;
- a call past its budget gets a cancel message and fails with ``timeout``;
  an interrupt sends the cancel message too, and the turn moves on at once;
- a client hook without a holder counts as a deny on the denying events
  (``user_prompt_submit``, ``pre_tool``, ``permission_request``: fail closed,
  as a crashed command hook) and as no opinion on the others.

Invariants:
- An answer is taken only from the connection the call was sent to, for a
  call of this supervisor instance (ids start at a random point); a late or
  foreign answer is ignored.
- A call's arguments are checked against the tool's declared JSON Schema
  (``supervisor/tools/schema.py``) before anything is sent: a refused call
  gets error kind ``bad_arguments`` and never reaches the program.
- Every wait has a deadline; nothing here blocks on a client.
- Each result carries an isolation record with ``tier: "client"`` and what
  the client reported of itself (pid, uid, host): the call ran outside the
  sandbox. Outputs are bounded by ``TOOL_OUTPUT_BYTES``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from broker.protocol import FailureKind
from sandbox_worker.api import (
    TOOL_NAMES,
    TOOL_OUTPUT_BYTES,
    ToolCallRequest,
    ToolCallResult,
    fit_text,
    replace_surrogates,
)
from supervisor.engine.config import SessionSpec
from supervisor.engine.errors import CallFailed
from supervisor.engine.hooks import DENYING_EVENTS, HookEvent, HookInput, HookResult, Middleware
from supervisor.server import CallError
from supervisor.store import SessionStore
from supervisor.store.records import SessionId
from supervisor.tools.router import refused
from supervisor.tools.schema import ArgumentsInvalid, SchemaProblem, check_schema, validate
from supervisor.wire import ErrorKind

log = logging.getLogger(__name__)

CLIENT_UNAVAILABLE: Final = "client_unavailable"
MAX_CLIENT_TOOLS: Final = 64
MAX_SCHEMA_CHARS: Final = 64 * 1024
MAX_WAIT_S: Final = 300.0
DEFAULT_WAIT_S: Final = 10.0
MAX_CACHED_SESSIONS: Final = 10_000
_NAME: Final = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")
SPEC_KEYS: Final = frozenset({"client_tools", "client_hooks", "client_wait_s"})

Send = Callable[[bytes, dict[str, Any]], bool]


def declaration(spec: dict[str, Any]) -> dict[str, Any]:
    """Pop and check the client-tool options of a create spec; return the
    fields they add to the session's ``extra``. ``CallError`` says what is wrong."""
    tools = spec.pop("client_tools", None) or []
    hooks = spec.pop("client_hooks", None) or []
    wait_s = spec.pop("client_wait_s", None)
    if not isinstance(tools, list) or len(tools) > MAX_CLIENT_TOOLS:
        raise CallError(ErrorKind.BAD_REQUEST,
                        f"client_tools must be a list of at most {MAX_CLIENT_TOOLS} tools")
    # The session's command tools (``command_tools`` once the facade parsed the
    # ``tools`` map, corral.toml's [tools.NAME] included) are names a client
    # tool may not take either.
    command_tools = spec.get("command_tools", spec.get("tools"))
    seen: set[str] = set(command_tools) if isinstance(command_tools, dict) else set()
    out_tools = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or set(tool) - {"name", "description", "parameters"}:
            raise CallError(ErrorKind.BAD_REQUEST, f"client_tools[{i}] must be a map of "
                            "name, description, parameters")
        name = tool.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise CallError(ErrorKind.BAD_REQUEST, f"client_tools[{i}].name must match "
                            f"{_NAME.pattern} (a provider's rule for tool names)")
        if name in TOOL_NAMES or name.startswith("mcp__") or name in seen:
            raise CallError(ErrorKind.BAD_REQUEST, f"client tool name {name!r} collides with "
                            "a built-in tool, an MCP tool, a command tool or another client "
                            "tool; rename it")
        seen.add(name)
        description = tool.get("description", "")
        params = tool.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(description, str) or len(description) > 4096:
            raise CallError(ErrorKind.BAD_REQUEST,
                            f"client tool {name!r}: description must be a string of at most "
                            "4096 characters")
        if not isinstance(params, dict) or params.get("type") != "object" \
                or len(repr(params)) > MAX_SCHEMA_CHARS:
            raise CallError(ErrorKind.BAD_REQUEST,
                            f"client tool {name!r}: parameters must be a JSON schema of type "
                            f"'object' (at most {MAX_SCHEMA_CHARS} characters)")
        try:
            check_schema(params)
        except SchemaProblem as exc:
            raise CallError(ErrorKind.BAD_REQUEST,
                            f"client tool {name!r}: parameters is not a valid JSON Schema: "
                            f"{exc}") from None
        out_tools.append({"name": name, "description": description, "parameters": params})
    events = {str(e) for e in HookEvent}
    if not isinstance(hooks, list) or not all(h in events for h in hooks):
        raise CallError(ErrorKind.BAD_REQUEST, f"client_hooks must be a list of hook events "
                        f"among {sorted(events)}")
    if wait_s is not None and (isinstance(wait_s, bool) or not isinstance(wait_s, int | float)
                               or not 0 <= wait_s <= MAX_WAIT_S):
        raise CallError(ErrorKind.BAD_REQUEST,
                        f"client_wait_s must be a number of seconds in [0, {MAX_WAIT_S:g}]")
    extra: dict[str, Any] = {}
    if out_tools:
        extra["client_tools"] = out_tools
    if hooks:
        extra["client_hooks"] = sorted(set(hooks))
    if (out_tools or hooks) and wait_s is not None:
        extra["client_wait_s"] = float(wait_s)
    return extra


def _clip_output(text: str) -> tuple[str, bool]:
    """The output within ``TOOL_OUTPUT_BYTES`` as a JSON string, as the tool
    service bounds its own (``sandbox_worker.api.fit_text``)."""
    return fit_text(replace_surrogates(text), TOOL_OUTPUT_BYTES,
                    "\n[... cut: {shown} of {total} bytes shown]")


@dataclass
class _Pending:
    identity: bytes
    session_id: str
    name: str
    future: asyncio.Future[dict[str, Any]]


@dataclass(frozen=True)
class _Declared:
    tools: frozenset[str]
    hooks: frozenset[str]
    wait_s: float
    schemas: Mapping[str, Any]  # tool -> its declared parameters (a JSON Schema)


class ClientToolHost:
    """The supervisor's side of client tools and hooks: who holds what, the
    calls in flight, and the engine router (``engine/routers.py``)."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store
        self._send: Send | None = None
        self._tools: dict[str, dict[str, bytes]] = {}  # session -> tool -> holder
        self._hooks: dict[str, bytes] = {}  # session -> holder
        self._declared: dict[str, _Declared] = {}  # immutable after creation: cached
        self._pending: dict[int, _Pending] = {}
        self._wakeups: dict[str, asyncio.Event] = {}
        # Call ids start at a random point: an answer a program sends to a restarted
        # supervisor (for a call of its predecessor) must not match a new call.
        self._ids = itertools.count(int.from_bytes(os.urandom(5), "big") + 1)

    def attach(self, send: Send) -> None:
        """The server's non-blocking send (False: not sent)."""
        self._send = send

    # -- registrations ------------------------------------------------------

    async def declared(self, session_id: str) -> _Declared | None:
        got = self._declared.get(session_id)
        if got is not None:
            return got
        record = await self.store.get_session(SessionId(session_id))
        if record is None:
            return None
        extra = record.config.get("extra") or {}
        schemas = {str(t.get("name")): t.get("parameters") or {}
                   for t in extra.get("client_tools") or [] if isinstance(t, dict)}
        got = _Declared(frozenset(schemas), frozenset(extra.get("client_hooks") or []),
                        float(extra.get("client_wait_s", DEFAULT_WAIT_S)), schemas)
        if len(self._declared) >= MAX_CACHED_SESSIONS:  # a cache: bounded, refilled on use
            self._declared.clear()
        self._declared[session_id] = got
        return got

    async def register(self, identity: bytes, tenant: str | None, session_id: str,
                       tools: list[str], hooks: bool) -> dict[str, Any]:
        """Make ``identity`` the holder of ``tools`` (and of the hooks) of a session."""
        record = await self.store.get_session(SessionId(session_id))
        if record is None or record.config.get("tenant") != tenant:
            raise CallError(ErrorKind.UNKNOWN_SESSION, f"no session {session_id!r}")
        declared = await self.declared(session_id)
        assert declared is not None  # the record exists
        undeclared = sorted(set(tools) - declared.tools)
        if undeclared:
            raise CallError(ErrorKind.BAD_REQUEST,
                            f"session {session_id} declares no client tool(s) {undeclared}; "
                            f"client tools are declared when the session is created "
                            f"(declared: {sorted(declared.tools)})")
        held = self._tools.setdefault(session_id, {})
        for name in tools:
            held[name] = identity
        if hooks and declared.hooks:
            self._hooks[session_id] = identity
        wake = self._wakeups.pop(session_id, None)
        if wake is not None:
            wake.set()
        log.info("client %s holds %d tool(s)%s of session %s", identity.hex()[:16],
                 len(tools), " and its hooks" if hooks and declared.hooks else "", session_id)
        return {"tools": sorted(tools), "hooks": sorted(declared.hooks) if hooks else []}

    def client_gone(self, identity: bytes) -> None:
        """A client was dropped: it holds nothing more, its calls end unknown."""
        for held in self._tools.values():
            for name in [n for n, who in held.items() if who == identity]:
                del held[name]
        for sid in [s for s, who in self._hooks.items() if who == identity]:
            del self._hooks[sid]
        for rid, pending in list(self._pending.items()):
            if pending.identity == identity and not pending.future.done():
                log.warning("client %s went away with %s of session %s in flight (call %d)",
                            identity.hex()[:16], pending.name, pending.session_id, rid)
                pending.future.set_exception(CallFailed(
                    FailureKind.WORKER_LOST,
                    f"the client program holding {pending.name!r} went away while it ran; "
                    "whether it had any effect is unknown", True))

    def resolve(self, identity: bytes, rid: int, answer: Any) -> bool:
        """A client's answer to call ``rid``; False when stale or not its own."""
        pending = self._pending.get(rid)
        if pending is None or pending.identity != identity or pending.future.done():
            return False
        if not isinstance(answer, dict):
            answer = {"malformed": True}
        pending.future.set_result(answer)
        return True

    async def _holder(self, session_id: str, name: str | None, wait_s: float) -> bytes | None:
        """The holder of a tool (``name``) or of the hooks (None), waiting for a
        registration at most ``wait_s``; None when there is none by then."""
        deadline = time.monotonic() + wait_s
        while True:
            who = self._tools.get(session_id, {}).get(name) if name is not None \
                else self._hooks.get(session_id)
            if who is not None:
                return who
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            wake = self._wakeups.setdefault(session_id, asyncio.Event())
            # One event per session waited on, removed when a program registers.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await wake.wait()

    async def _roundtrip(self, identity: bytes, session_id: str, name: str,
                         body: dict[str, Any], budget_s: float) -> dict[str, Any]:
        rid = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = _Pending(identity, session_id, name, fut)
        try:
            sent = self._send is not None and self._send(identity, {"client_call": {
                "id": rid, "session_id": session_id, "name": name, "budget_s": budget_s,
                **body}})
            if not sent:
                raise CallFailed(CLIENT_UNAVAILABLE, f"the client program holding {name!r} "
                                 "could not be reached; the call was not run", False)
            try:
                async with asyncio.timeout(budget_s):
                    return await fut
            except TimeoutError:
                self._cancel(identity, rid)
                raise CallFailed(FailureKind.TIMEOUT, f"{name!r} did not answer within its "
                                 f"budget of {budget_s:.1f}s; it was asked to cancel",
                                 False) from None
            except asyncio.CancelledError:
                self._cancel(identity, rid)  # a non-blocking send: bounded cleanup
                raise
        finally:
            self._pending.pop(rid, None)

    def _cancel(self, identity: bytes, rid: int) -> None:
        if self._send is not None:
            self._send(identity, {"client_cancel": {"id": rid}})

    # -- the engine router (engine/routers.py) --------------------------------

    async def routes(self, request: ToolCallRequest) -> bool:
        declared = await self.declared(str(request.get("session_id", "")))
        return declared is not None and request.get("tool") in declared.tools

    async def call(self, request: ToolCallRequest, *, budget_s: float,
                   on_partial: Callable[[Any], Awaitable[None]] | None = None
                   ) -> ToolCallResult:
        sid, name = str(request["session_id"]), str(request["tool"])
        declared = await self.declared(sid)
        if declared is not None and name in declared.schemas:
            # Checked here, as command and MCP tools are (supervisor/tools/schema.py):
            # a call the schema refuses never reaches the program.
            try:
                validate(declared.schemas[name], request.get("arguments", {}))
            except (ArgumentsInvalid, SchemaProblem) as exc:
                return refused(request, "bad_arguments", f"Tool call not run: {exc}")
        wait_s = min(declared.wait_s if declared else DEFAULT_WAIT_S, budget_s)
        started = time.monotonic()
        identity = await self._holder(sid, name, wait_s)
        if identity is None:
            raise CallFailed(CLIENT_UNAVAILABLE, f"no client program holding {name!r} is "
                             f"connected to this session (waited {wait_s:g}s); the call was "
                             "not run", False)
        left = max(0.05, budget_s - (time.monotonic() - started))
        answer = await self._roundtrip(identity, sid, name, {
            "kind": "tool", "call_id": request["call_id"],
            "arguments": request.get("arguments", {})}, left)
        given = answer.get("output")
        is_error = answer.get("is_error", False)
        if not isinstance(given, str) or not isinstance(is_error, bool):
            raise CallFailed(FailureKind.PROTOCOL, f"the client answered {name!r} with a "
                             "malformed result", False)
        # A large answer (up to a message's 8 MiB) is measured off the loop.
        output, truncated = _clip_output(given) if len(given) <= 64 * 1024 \
            else await asyncio.to_thread(_clip_output, given)
        truncated = truncated or answer.get("truncated") is True  # cut by the program
        raw_client = answer.get("client")
        client: dict[str, Any] = raw_client if isinstance(raw_client, dict) else {}
        isolation: dict[str, Any] = {
            "tier": "client", "filesystem": "host", "network": "host",
            "pid_namespace": False, "seccomp": False,
            "uid": client.get("uid") if isinstance(client.get("uid"), int) else -1,
            "limits": {}, "unsandboxed_opt_in": True, "kernel": None,
            "degraded": ["ran in the client program that registered it, outside the "
                         "sandbox"],
            "client": {k: client[k] for k in ("pid", "uid", "host")
                       if isinstance(client.get(k), int | str)}}
        result: dict[str, Any] = {
            "call_id": request["call_id"], "tool": name,
            "outcome": "error" if is_error else "ok", "is_error": is_error, "output": output,
            "exit_code": None, "signal": None,
            "duration_s": round(time.monotonic() - started, 6),
            "stdout_bytes": len(output.encode("utf-8", "replace")), "stderr_bytes": 0,
            "truncated": truncated, "isolation": isolation}
        kind = answer.get("error_kind")
        if is_error and isinstance(kind, str):
            result["error_kind"] = kind[:64]
        return result  # type: ignore[return-value]

    # -- hooks --------------------------------------------------------------

    async def call_hook(self, inp: HookInput, timeout_s: float) -> HookResult | None:
        declared = await self.declared(inp.session_id)
        wait_s = min(declared.wait_s if declared else DEFAULT_WAIT_S, timeout_s / 2)
        started = time.monotonic()
        identity = await self._holder(inp.session_id, None, wait_s)
        try:
            if identity is None:
                raise CallFailed(CLIENT_UNAVAILABLE, "no client holds the hooks", False)
            left = max(0.05, timeout_s - (time.monotonic() - started))
            answer = await self._roundtrip(identity, inp.session_id, str(inp.event), {
                "kind": "hook", "input": inp.to_json()}, left)
        except CallFailed as exc:
            if exc.kind == FailureKind.TIMEOUT:
                raise
            log.warning("session %s: client hook %s not run: %s", inp.session_id, inp.event,
                        exc.message)
            if inp.event in DENYING_EVENTS:  # fail closed, as a crashed command hook
                return HookResult(deny=f"the client program holding this session's "
                                       f"{inp.event} hook is not connected")
            return None
        if "error" in answer:
            raise RuntimeError(f"the client's hook raised: {str(answer['error'])[:2000]}")
        return HookResult.from_json(answer.get("hook") or {})

    def middlewares(self, spec: SessionSpec) -> Sequence[Middleware]:
        """The engine's middleware factory: a forwarder for the declared hooks."""
        events = spec.extra.get("client_hooks")
        if not isinstance(events, list) or not events:
            return []
        return [ClientHooks(self, frozenset(str(e) for e in events))]


class ClientHooks(Middleware):
    """Forwards the declared hook events to the client program holding them."""

    name = "client_hooks"

    def __init__(self, host: ClientToolHost, events: frozenset[str],
                 timeout_s: float = 25.0) -> None:  # inside the runner's 30 s
        self.host = host
        self.events = events
        self.timeout_s = timeout_s

    async def _forward(self, inp: HookInput) -> HookResult | None:
        if str(inp.event) not in self.events:
            return None
        return await self.host.call_hook(inp, self.timeout_s)

    async def session_start(self, inp: HookInput) -> HookResult | None:
        return await self._forward(inp)

    async def user_prompt_submit(self, inp: HookInput) -> HookResult | None:
        return await self._forward(inp)

    async def pre_model(self, inp: HookInput) -> HookResult | None:
        return await self._forward(inp)

    async def model_request(self, inp: HookInput) -> HookResult | None:
        return await self._forward(inp)

    async def pre_tool(self, inp: HookInput) -> HookResult | None:
        return await self._forward(inp)

    async def permission_request(self, inp: HookInput) -> HookResult | None:
        return await self._forward(inp)

    async def post_tool(self, inp: HookInput) -> HookResult | None:
        return await self._forward(inp)

    async def pre_compact(self, inp: HookInput) -> HookResult | None:
        return await self._forward(inp)

    async def post_compact(self, inp: HookInput) -> HookResult | None:
        return await self._forward(inp)

    async def stop(self, inp: HookInput) -> HookResult | None:
        return await self._forward(inp)

    async def turn_end(self, inp: HookInput) -> HookResult | None:
        return await self._forward(inp)

    async def session_end(self, inp: HookInput) -> HookResult | None:
        return await self._forward(inp)
