"""Middleware hooks: the fixed events, one input object each, in declared order.

A ``Middleware`` overrides any of the async hook methods below; each gets one
``HookInput`` and returns a ``HookResult`` (or None for "no opinion").
``HookRunner`` calls the session's middlewares in their declared order and
folds the results with the rule of each event:

=====================  =====================================================
session_start          source startup|resume|compact; ``stop`` (first wins),
                       ``push_input`` (all, in order)
user_prompt_submit     ``reject`` (first wins: nothing of the prompt is ever
                       persisted), ``text`` (enrich; chained), ``context``
pre_model              ``append_items`` / ``rewrite_items`` (durable)
model_request          ``request`` (replaces the request; chained) or in-place
                       edits of ``data["request"]``; never persisted
pre_tool               ``arguments`` (rewrite; chained), ``deny`` (sticky),
                       ``context`` (durable before the function_call item)
permission_request     ``allow`` / ``deny``: any deny wins and no later hook
                       can weaken it
post_tool              only after a real execution: ``output`` (replace;
                       chained), ``context`` (right after the output)
pre_compact            ``stop``: a warning, the turn completes, no compaction
post_compact           ``stop``: a warning, the turn completes (compaction kept)
stop                   ``continue_with``: one bounded continuation
turn_end, session_end  observe only
=====================  =====================================================

Invariants:
- A hook that raises, or overruns ``timeout_s``, is an infrastructure failure:
  ``HookFailed`` (the turn fails cleanly with a record; the session lives on).
  ``CancelledError`` is never caught.
- Hooks see copies of the context; only the folded results change anything.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from supervisor.engine.errors import HookFailed

log = logging.getLogger(__name__)

# Telemetry's hook observer: (hook, event, session_id, turn_id) -> a callable
# told how the hook ended (None: fine). Installed by supervisor.telemetry.
HookObserver = Callable[[str, str, str, str | None], Callable[[BaseException | None], None]]
_observer: HookObserver | None = None


def set_hook_observer(observer: HookObserver | None) -> None:
    global _observer
    _observer = observer


def _observed(method: Any, ended: Callable[[BaseException | None], None]) -> Any:
    async def run(inp: Any) -> Any:
        try:
            result = await method(inp)
        except BaseException as exc:
            ended(exc)
            raise
        ended(None)
        return result
    return run


class HookEvent(StrEnum):
    SESSION_START = "session_start"
    USER_PROMPT_SUBMIT = "user_prompt_submit"
    PRE_MODEL = "pre_model"
    MODEL_REQUEST = "model_request"
    PRE_TOOL = "pre_tool"
    PERMISSION_REQUEST = "permission_request"
    POST_TOOL = "post_tool"
    PRE_COMPACT = "pre_compact"
    POST_COMPACT = "post_compact"
    STOP = "stop"
    TURN_END = "turn_end"
    SESSION_END = "session_end"


# Events whose hooks may deny; a command hook that times out or crashes on one
# of these counts as a deny (fail closed) instead of failing the turn.
DENYING_EVENTS = frozenset({HookEvent.USER_PROMPT_SUBMIT, HookEvent.PRE_TOOL,
                            HookEvent.PERMISSION_REQUEST})


@dataclass(slots=True)
class HookInput:
    """The one object a hook receives. ``data`` holds the event's fields."""

    event: HookEvent
    session_id: str
    turn_id: str | None
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"event": str(self.event), "session_id": self.session_id,
                "turn_id": self.turn_id, **self.data}


@dataclass(slots=True)
class HookResult:
    """What a hook may ask for; each event reads only its own fields."""

    stop: str | None = None
    push_input: str | None = None
    reject: str | None = None
    text: str | None = None
    context: str | None = None
    append_items: list[dict[str, Any]] | None = None
    rewrite_items: list[dict[str, Any]] | None = None
    request: dict[str, Any] | None = None
    arguments: dict[str, Any] | None = None
    deny: str | None = None
    allow: bool = False
    output: str | None = None
    continue_with: str | None = None

    @classmethod
    def from_json(cls, d: Any) -> HookResult:
        """Read a command hook's stdout object; unknown or mistyped keys raise."""
        if not isinstance(d, dict):
            raise ValueError("a hook result must be a JSON object")
        res = cls()
        for key, value in d.items():
            if key in ("stop", "push_input", "reject", "text", "context", "deny", "output",
                       "continue_with"):
                if value is not None and not isinstance(value, str):
                    raise ValueError(f"hook result {key!r} must be a string")
                setattr(res, key, value)
            elif key in ("append_items", "rewrite_items"):
                if value is not None and not (
                    isinstance(value, list) and all(isinstance(i, dict) for i in value)
                ):
                    raise ValueError(f"hook result {key!r} must be a list of objects")
                setattr(res, key, value)
            elif key in ("request", "arguments"):
                if value is not None and not isinstance(value, dict):
                    raise ValueError(f"hook result {key!r} must be an object")
                setattr(res, key, value)
            elif key == "allow":
                res.allow = bool(value)
            elif key == "decision":  # {"decision": "allow"|"deny", "reason": ...}
                if value == "deny":
                    res.deny = str(d.get("reason") or "denied by hook")
                elif value == "allow":
                    res.allow = True
            elif key != "reason":
                raise ValueError(f"unknown hook result key {key!r}")
        return res


class Middleware:
    """Base class: override the hooks you need. ``name`` appears in errors."""

    name = "middleware"

    async def session_start(self, inp: HookInput) -> HookResult | None:
        return None

    async def user_prompt_submit(self, inp: HookInput) -> HookResult | None:
        return None

    async def pre_model(self, inp: HookInput) -> HookResult | None:
        return None

    async def model_request(self, inp: HookInput) -> HookResult | None:
        return None

    async def pre_tool(self, inp: HookInput) -> HookResult | None:
        return None

    async def permission_request(self, inp: HookInput) -> HookResult | None:
        return None

    async def post_tool(self, inp: HookInput) -> HookResult | None:
        return None

    async def pre_compact(self, inp: HookInput) -> HookResult | None:
        return None

    async def post_compact(self, inp: HookInput) -> HookResult | None:
        return None

    async def stop(self, inp: HookInput) -> HookResult | None:
        return None

    async def turn_end(self, inp: HookInput) -> HookResult | None:
        return None

    async def session_end(self, inp: HookInput) -> HookResult | None:
        return None


def context_item(kind: str, text: str) -> dict[str, Any]:
    """A hook's added context, as a developer message tagged with its kind."""
    return {"type": "message", "role": "developer",
            "content": [{"type": "input_text", "text": text}], "corral": {"kind": kind}}


@dataclass(slots=True)
class Folded:
    """The fold of one event's results over all middlewares."""

    stop: str | None = None
    reject: str | None = None
    deny: str | None = None
    allow: bool = False
    text: str | None = None
    arguments: dict[str, Any] | None = None
    output: str | None = None
    continue_with: str | None = None
    request: dict[str, Any] | None = None
    push_inputs: list[str] = field(default_factory=list)
    contexts: list[str] = field(default_factory=list)
    append_items: list[dict[str, Any]] = field(default_factory=list)
    rewrite_items: list[dict[str, Any]] | None = None


class HookRunner:
    """Runs one event through the middlewares, in their declared order."""

    def __init__(self, middlewares: Sequence[Middleware], *, timeout_s: float = 30.0) -> None:
        self.middlewares = tuple(middlewares)
        self.timeout_s = timeout_s

    async def run(self, event: HookEvent, session_id: str, turn_id: str | None,
                  data: dict[str, Any]) -> Folded:
        folded = Folded()
        data = dict(data)
        for mw in self.middlewares:
            method = getattr(mw, str(event))
            # Each hook sees the fold so far (chained rewrites) and copies only.
            inp = HookInput(event, session_id, turn_id, copy.deepcopy(data))
            if event is HookEvent.MODEL_REQUEST:
                inp.data["request"] = data["request"]  # edited in place on purpose
            if _observer is not None:  # telemetry's span of this hook (None when off)
                method = _observed(method, _observer(mw.name, str(event), session_id, turn_id))
            try:
                async with asyncio.timeout(self.timeout_s):
                    result = await method(inp)
            except TimeoutError as exc:
                raise HookFailed(f"{mw.name}.{event} timed out after {self.timeout_s}s") from exc
            except HookFailed:
                raise
            except Exception as exc:  # a hook is foreign code: translate at this boundary
                log.warning("hook %s.%s raised", mw.name, event, exc_info=True)
                raise HookFailed(f"{mw.name}.{event} failed: {exc}") from exc
            if result is None:
                continue
            self._fold(event, folded, result, data)
            if folded.reject is not None or (folded.stop is not None and event in (
                    HookEvent.PRE_COMPACT, HookEvent.POST_COMPACT)):
                break
        return folded

    @staticmethod
    def _fold(event: HookEvent, f: Folded, r: HookResult, data: dict[str, Any]) -> None:
        if r.stop is not None and f.stop is None:
            f.stop = r.stop
        if r.push_input is not None:
            f.push_inputs.append(r.push_input)
        if r.reject is not None and f.reject is None:
            f.reject = r.reject
        if r.text is not None:
            f.text = r.text
            data["text"] = r.text
        if r.context:
            f.contexts.append(r.context)
        if r.append_items:
            f.append_items.extend(r.append_items)
        if r.rewrite_items is not None:
            f.rewrite_items = r.rewrite_items
        if r.request is not None:
            f.request = r.request
            data["request"] = r.request
        if r.arguments is not None and f.deny is None:
            f.arguments = r.arguments
            data["arguments"] = r.arguments
        if r.deny is not None and f.deny is None:
            f.deny = r.deny  # sticky: no later hook can weaken it
        if r.allow and event is HookEvent.PERMISSION_REQUEST:
            f.allow = True
        if r.output is not None:
            f.output = r.output
            data["output"] = r.output
        if r.continue_with is not None and f.continue_with is None:
            f.continue_with = r.continue_with
