"""``Corral`` (a connection to a farm's supervisor) and ``Session`` (one session
reached through it): the asyncio API of ``supervisor.sdk``.

A ``Corral`` wraps ``supervisor.client.SupervisorClient`` (deadlines on every
call, resubscription after a supervisor restart) and adds what a program
needs to drive sessions: typed options and events, and the client side of
client tools and client hooks.

Client tools and hooks: ``create_session(..., tools=[...], hooks={...})``
declares them in the session's config and makes this connection their
holder (``register_client``); ``resume`` holds them again for an existing
session. The supervisor pushes each call (``client_call``) over this
connection; it runs here, in this program (sync functions in a thread), and
its answer goes back with ``client_result``. After the supervisor restarts
or this connection is replaced, the calls still running here are cancelled
(their answer has nowhere to go) and the holds are registered again at once.
What happens while no holder is connected is the supervisor's documented
rule (``supervisor/clienttools.py``, docs/tools.md).

Invariants:
- Every task this connection starts (a pushed call, a re-registration) is
  owned by its TaskGroup and ends with it; a cancel from the supervisor
  cancels the call's task.
- Nothing here waits on the supervisor without a deadline (the client's
  ``timeout_s``, or the ``timeout_s`` a turn is run with).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from broker.security import CurveClient
from sandbox_worker.api import TOOL_OUTPUT_BYTES, fit_text, replace_surrogates
from supervisor.client import SupervisorClient, SupervisorError, SupervisorUnavailable
from supervisor.engine.hooks import HookEvent, HookInput, HookResult
from supervisor.sdk.events import TERMINAL, Event, parse_event
from supervisor.sdk.options import SessionOptions
from supervisor.sdk.tools import ClientTool, ToolOutcome

log = logging.getLogger(__name__)

HookFunction = Callable[[HookInput], "HookResult | Awaitable[HookResult | None] | None"]
Decision = Literal["approved", "approved_for_session", "denied", "abort"]
_REREGISTER_DEADLINE_S = 60.0
_INLINE_FIT_CHARS = 64 * 1024  # below this an output always fits: no measuring


def _fit(output: str) -> tuple[str, bool]:
    return fit_text(replace_surrogates(output), TOOL_OUTPUT_BYTES,
                    "\n[... cut: {shown} of {total} bytes shown]")


@dataclass
class _Held:
    tools: dict[str, ClientTool] = field(default_factory=dict)
    hooks: dict[str, HookFunction] = field(default_factory=dict)



def check_timeout(timeout_s: float | None) -> None:
    """A deadline is a number of seconds above 0 (or None: no bound, where allowed):
    ``timeout_s=-1`` raised an empty ``TimeoutError`` after the turn was sent."""
    if timeout_s is None:
        return
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) \
            or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a number of seconds above 0, got {timeout_s!r}")

class Corral:
    """A connection to a farm's supervisor. Use as ``async with``.

    ``endpoint`` is the supervisor's client endpoint (``ipc://...`` of a local
    farm, or ``tcp://HOST:PORT`` with ``curve`` keys, docs/multihost.md);
    ``Corral.for_home(HOME)`` finds a running local farm's endpoint.
    ``liveness_s``: after this long without a heartbeat from this program the
    supervisor drops the connection and its client tool calls end unknown."""

    def __init__(self, endpoint: str, *, curve: CurveClient | None = None,
                 timeout_s: float = 10.0, liveness_s: float = 3.0) -> None:
        check_timeout(timeout_s)
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.liveness_s = liveness_s
        self._sv = SupervisorClient(endpoint, timeout_s=timeout_s, curve=curve)
        self._held: dict[str, _Held] = {}
        self._running: dict[int, asyncio.Task[None]] = {}
        self._tg: asyncio.TaskGroup | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._me = {"pid": os.getpid(), "uid": os.getuid(), "host": socket.gethostname()}

    @classmethod
    def for_home(cls, home: str | Path, **kwargs: Any) -> Corral:
        """A connection to the farm running at ``home`` (``corral up``);
        ``SupervisorUnavailable`` when none runs there."""
        from supervisor.farm.layout import FarmPaths
        from supervisor.farm.root import running_farm

        if running_farm(Path(home)) is None:
            raise SupervisorUnavailable(f"no farm is running at {home}; start one with: "
                                        f"corral up --home {home} --detach")
        return cls(FarmPaths.of(Path(home)).supervisor_endpoint, **kwargs)

    @property
    def client(self) -> SupervisorClient:
        """The underlying protocol client (``supervisor.client``)."""
        return self._sv

    async def __aenter__(self) -> Corral:
        async with contextlib.AsyncExitStack() as stack:
            self._tg = await stack.enter_async_context(asyncio.TaskGroup())
            stack.callback(self._cancel_all)  # runs before the TaskGroup waits
            self._sv.on_push = self._on_push
            self._sv.on_reconnect = self._on_reconnect
            await stack.enter_async_context(self._sv)
            self._stack = stack.pop_all()
        return self

    async def __aexit__(self, *exc: object) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.__aexit__(None, None, None)
        self._tg = None

    def _cancel_all(self) -> None:
        for task in list(self._running.values()):
            task.cancel()

    # -- sessions -----------------------------------------------------------

    async def create_session(self, options: SessionOptions, *,
                             tools: Sequence[ClientTool] = (),
                             hooks: Mapping[str | HookEvent, HookFunction] | None = None,
                             ) -> Session:
        """Create a session; ``tools`` and ``hooks`` run in this program."""
        spec = options.to_spec()
        if "route_spec" in spec:
            spec["route_spec"] = await self._with_provider(spec["route_spec"])
        held = _held(tools, hooks)
        if held.tools:
            spec["client_tools"] = [t.declaration() for t in held.tools.values()]
        if held.hooks:
            spec["client_hooks"] = sorted(held.hooks)
        sid = await self._sv.create_session(**spec)
        if held.tools or held.hooks:
            self._held[sid] = held
            await self._register(sid)
        return Session(self, sid)

    async def resume(self, session_id: str, *, tools: Sequence[ClientTool] = (),
                     hooks: Mapping[str | HookEvent, HookFunction] | None = None) -> Session:
        """An existing session; ``tools`` / ``hooks`` hold (some of) what it declared."""
        await self._sv.describe(session_id)  # unknown_session, typed, when it is not there
        held = _held(tools, hooks)
        if held.tools or held.hooks:
            self._held[session_id] = held
            await self._register(session_id)
        return Session(self, session_id)

    async def list_sessions(self, *, limit: int = 100) -> list[dict[str, Any]]:
        result = await self._sv.list_sessions(limit=limit)
        return list(result.get("sessions", []))

    async def status(self) -> dict[str, Any]:
        return dict(await self._sv.status())

    async def _with_provider(self, route: dict[str, Any]) -> dict[str, Any]:
        """A ``script:PATH`` route gets its scripted provider started for the
        life of this connection (as ``corral run`` does for the run)."""
        if not route.get("script") or self._stack is None:
            return route
        from supervisor.cli.run import scripted_provider

        script = await asyncio.to_thread(Path(str(route["script"])).resolve)
        if not await asyncio.to_thread(script.is_file):
            raise ValueError(f"script {script} does not exist")
        logs = await asyncio.to_thread(tempfile.mkdtemp, prefix="corral-sdk-provider-")
        self._stack.callback(shutil.rmtree, logs, True)
        url = await self._stack.enter_async_context(scripted_provider(script, Path(logs)))
        return {**route, "script": str(script), "base_url": url}

    # -- client tools and hooks ----------------------------------------------

    async def _register(self, session_id: str) -> None:
        held = self._held[session_id]
        await self._sv.call("register_client", session_id=session_id,
                            tools=sorted(held.tools), hooks=bool(held.hooks),
                            liveness_s=self.liveness_s)

    def _on_reconnect(self) -> None:
        # The calls of the supervisor we lost have nowhere to answer (it marked
        # them unknown, or its successor did): stop them here too.
        self._cancel_all()
        if self._tg is not None and self._held:
            self._tg.create_task(self._reregister(), name="sdk-reregister")

    async def _reregister(self) -> None:
        deadline = time.monotonic() + _REREGISTER_DEADLINE_S
        for sid in list(self._held):
            while True:
                try:
                    await self._register(sid)
                    break
                except SupervisorUnavailable:
                    if time.monotonic() > deadline:
                        log.warning("could not hold the client tools of %s again", sid)
                        break
                except SupervisorError as exc:
                    log.warning("session %s: client tools not held again: %s", sid, exc)
                    break

    def _on_push(self, msg: dict[str, Any]) -> None:
        if "client_cancel" in msg:
            rid = (msg.get("client_cancel") or {}).get("id")
            task = self._running.get(rid) if isinstance(rid, int) else None
            if task is not None:
                task.cancel()
            return
        call = msg.get("client_call")
        if not isinstance(call, dict) or not isinstance(call.get("id"), int) \
                or self._tg is None:
            return
        rid = call["id"]
        task = self._tg.create_task(self._serve(rid, call), name=f"sdk-client-call-{rid}")
        self._running[rid] = task
        task.add_done_callback(lambda _t: self._running.pop(rid, None))

    async def _serve(self, rid: int, call: dict[str, Any]) -> None:
        held = self._held.get(str(call.get("session_id")))
        name = str(call.get("name"))
        result: dict[str, Any]
        if call.get("kind") == "hook":
            result = await self._run_hook(held, name, call)
        else:
            tool = held.tools.get(name) if held else None
            args = call.get("arguments")
            if tool is None:
                outcome = ToolOutcome(f"no client tool {name!r} in this program", True,
                                      "unknown_tool")
            else:
                outcome = await tool.invoke(args if isinstance(args, dict) else {})
            # Bounded here too, so the answer fits one message (the supervisor
            # cuts again: it trusts no program). A large one is measured in a
            # thread: this loop keeps the connection's heartbeats going.
            output, cut = outcome.output, False
            if len(output) > _INLINE_FIT_CHARS:
                output, cut = await asyncio.to_thread(_fit, output)
            result = {"output": output, "is_error": outcome.is_error, "client": self._me,
                      "truncated": cut}
            if outcome.error_kind:
                result["error_kind"] = outcome.error_kind
        with contextlib.suppress(SupervisorError):  # gone: the supervisor's rule applies
            await self._sv.call("client_result", id=rid, result=result)

    async def _run_hook(self, held: _Held | None, name: str,
                        call: dict[str, Any]) -> dict[str, Any]:
        fn = held.hooks.get(name) if held else None
        given = call.get("input")
        raw: dict[str, Any] = given if isinstance(given, dict) else {}
        data = {k: v for k, v in raw.items() if k not in ("event", "session_id", "turn_id")}
        if fn is None:
            return {"hook": {}}
        try:
            turn = raw.get("turn_id")
            inp = HookInput(HookEvent(name), str(call.get("session_id")),
                            turn if isinstance(turn, str) else None, data)
            value = fn(inp)
            if inspect.isawaitable(value):
                value = await value
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the user's hook: reported as data, logged here
            log.warning("client hook %s raised", name, exc_info=True)
            return {"error": f"{type(exc).__name__}: {exc}"}
        if value is None:
            return {"hook": {}}
        if not isinstance(value, HookResult):
            return {"error": f"hook {name} returned {type(value).__name__}, not a HookResult"}
        return {"hook": {k: v for k, v in dataclasses.asdict(value).items()
                         if v is not None and v is not False}}


def _held(tools: Sequence[ClientTool],
          hooks: Mapping[str | HookEvent, HookFunction] | None) -> _Held:
    held = _Held()
    for t in tools:
        if not isinstance(t, ClientTool):
            raise TypeError(f"{t!r} is not a ClientTool; decorate it with @tool")
        if t.name in held.tools:
            raise ValueError(f"two client tools are named {t.name!r}")
        held.tools[t.name] = t
    for event, fn in (hooks or {}).items():
        held.hooks[str(HookEvent(event))] = fn  # ValueError for an unknown event
    return held


class Session:
    """One session reached through a ``Corral`` connection."""

    def __init__(self, corral: Corral, session_id: str) -> None:
        self.corral = corral
        self.id = session_id

    def __repr__(self) -> str:
        return f"Session({self.id!r})"

    @property
    def _sv(self) -> SupervisorClient:
        return self.corral.client

    async def describe(self) -> dict[str, Any]:
        """State, route, workspace, the active turn and any pending approval."""
        return dict(await self._sv.describe(self.id))

    async def submit(self, prompt: str) -> str:
        """Queue one user turn; returns its submission id (the events carry it)."""
        return await self._sv.submit(self.id, {"type": "user_input", "text": prompt})

    async def run(self, prompt: str, *, timeout_s: float | None = None
                  ) -> AsyncGenerator[Event, None]:
        """Submit ``prompt`` and yield the turn's events, ending with its
        ``TurnComplete`` or ``TurnAborted``. ``timeout_s`` bounds each wait for
        the next event (``TimeoutError``; the turn goes on in the farm);
        ``ValueError`` when it is not above 0 (checked before the turn is sent)."""
        check_timeout(timeout_s)
        after = int((await self.describe()).get("last_event_sequence", 0))
        submission = await self.submit(prompt)
        # aclosing: leaving early unsubscribes now, not when the generator is collected.
        async with contextlib.aclosing(self.events(after_sequence=after,
                                                   timeout_s=timeout_s)) as stream:
            async for event in stream:
                if event.submission_id != submission:
                    continue
                yield event
                if isinstance(event, TERMINAL):
                    return

    async def events(self, *, after_sequence: int = 0, timeout_s: float | None = None
                     ) -> AsyncGenerator[Event, None]:
        """Every event after ``after_sequence`` (history, then live), forever."""
        check_timeout(timeout_s)
        stream = self._sv.events(self.id, after_sequence=after_sequence)
        assert isinstance(stream, AsyncGenerator)  # an async generator function's
        try:
            while True:
                async with asyncio.timeout(timeout_s):
                    raw = await anext(stream)
                yield parse_event(raw)
        finally:
            await stream.aclose()

    async def approve(self, approval_id: str, decision: Decision = "approved") -> None:
        """Answer an ``ExecApprovalRequest``."""
        await self._sv.submit(self.id, {"type": "exec_approval", "id": approval_id,
                                        "decision": decision})

    async def interrupt(self, turn_id: str | None = None) -> bool:
        """Interrupt ``turn_id`` (default: the running turn); False when none runs."""
        if turn_id is None:
            active = (await self.describe()).get("active_turn") or {}
            turn_id = active.get("turn_id") if isinstance(active, dict) else None
            if not isinstance(turn_id, str):
                return False
        await self._sv.submit(self.id, {"type": "interrupt", "turn_id": turn_id})
        return True

    async def set_model(self, model: str, base_url: str | None = None) -> None:
        """Switch the route for the next turns (a name, or ``PROVIDER:MODEL``)."""
        op: dict[str, Any] = {"type": "set_model", "route": model}
        if ":" in model:
            from sandbox_worker.api import parse_route

            op["route_spec"] = await self.corral._with_provider(
                dict(parse_route(model, base_url, name=model)))
        await self._sv.submit(self.id, op)

    async def compact(self) -> None:
        await self._sv.submit(self.id, {"type": "compact"})

    async def terminate(self) -> None:
        """Shut the session down (it takes no more turns; its history stays)."""
        await self._sv.submit(self.id, {"type": "shutdown"})

    async def export(self) -> dict[str, Any]:
        """The latest portable checkpoint (made at each tool boundary), as the
        document ``corral export`` writes; ``import_checkpoint`` resumes it."""
        result = await self._sv.export(self.id)
        return dict(result["checkpoint"])
