"""Client tools: Python functions of the calling program offered to the model.

``@tool`` turns a function (sync or async) into a ``ClientTool``: its name,
its description (the docstring's first paragraph) and the JSON schema of its
arguments, derived from the type hints, or given explicitly with
``parameters=``. The supervisor routes the model's calls of it back to the
program that registered it (``supervisor/clienttools.py``); there it runs,
outside the sandbox.

Type hints understood: ``str``, ``int``, ``float``, ``bool``, ``list[T]`` /
``tuple[T, ...]``, ``dict[str, T]``, ``Literal[...]``, ``T | None``, and any
of these nested. A parameter with a default is optional. Anything else needs
an explicit ``parameters`` schema (``TypeError`` says which parameter).

Invariants:
- ``invoke`` never raises for a call the model made: bad arguments and an
  exception of the function become an error result with a kind
  (``bad_arguments``, ``client_tool_raised``); the traceback stays in this
  program's log. ``CancelledError`` is re-raised.
- A sync function runs in a thread (the connection's heartbeats go on);
  an async one runs as a task and is cancelled by an interrupt.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, overload

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

_SCALARS: dict[Any, dict[str, Any]] = {
    str: {"type": "string"}, int: {"type": "integer"}, float: {"type": "number"},
    bool: {"type": "boolean"},
}


def _schema_of(hint: Any, where: str) -> dict[str, Any]:
    if hint in _SCALARS:
        return dict(_SCALARS[hint])
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Literal:
        return {"enum": list(args)}
    if origin in (list, tuple) or hint in (list, tuple):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            raise TypeError(f"{where}: only tuple[T, ...] is supported; give parameters=")
        item = args[0] if args else None
        return {"type": "array", **({"items": _schema_of(item, where)} if item else {})}
    if origin is dict or hint is dict:
        if args and args[0] is not str:
            raise TypeError(f"{where}: dict keys must be str")
        return {"type": "object",
                **({"additionalProperties": _schema_of(args[1], where)} if args else {})}
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return {"anyOf": [_schema_of(rest[0], where), {"type": "null"}]}
        return {"anyOf": [_schema_of(a, where) for a in args]}
    if hint is Any:
        return {}
    raise TypeError(f"{where}: no JSON schema for type {hint!r}; give parameters=")


def schema_from_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema (type ``object``) of ``fn``'s keyword arguments."""
    sig = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn)
    except NameError as exc:  # a hint naming a class local to a function, say
        raise TypeError(f"{fn.__qualname__}: cannot resolve its type hints ({exc}); "
                        "give parameters=") from None
    props: dict[str, Any] = {}
    required: list[str] = []
    for name, param in sig.parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise TypeError(f"{fn.__qualname__}: parameter {name!r} must be passable by "
                            "keyword; give parameters=")
        if name not in hints:
            raise TypeError(f"{fn.__qualname__}: parameter {name!r} has no type hint")
        props[name] = _schema_of(hints[name], f"{fn.__qualname__}({name})")
        if param.default is param.empty:
            required.append(name)
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def _description(fn: Callable[..., Any]) -> str:
    doc = inspect.getdoc(fn) or ""
    return doc.split("\n\n", 1)[0].strip()


@dataclass(frozen=True, slots=True)
class ToolOutcome:
    """What a client tool call answers: the text the model reads."""

    output: str
    is_error: bool = False
    error_kind: str | None = None


@dataclass(frozen=True, slots=True)
class ClientTool:
    """A function offered to the model as a tool (see ``tool``)."""

    name: str
    description: str
    parameters: dict[str, Any]
    function: Callable[..., Any]

    def declaration(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description,
                "parameters": self.parameters}

    async def invoke(self, arguments: Mapping[str, Any]) -> ToolOutcome:
        """Run the function with the model's arguments; never raises but
        ``CancelledError``."""
        try:
            bound = inspect.signature(self.function).bind(**dict(arguments))
        except TypeError as exc:
            return ToolOutcome(f"bad arguments for {self.name}: {exc}", True, "bad_arguments")
        try:
            if inspect.iscoroutinefunction(self.function):
                value = await self.function(*bound.args, **bound.kwargs)
            else:
                value = await asyncio.to_thread(self.function, *bound.args, **bound.kwargs)
                if inspect.isawaitable(value):
                    value = await value
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the function is the user's code: a typed error result
            log.warning("client tool %s raised", self.name, exc_info=True)
            return ToolOutcome(f"{self.name} raised {type(exc).__name__}: {exc}", True,
                               "client_tool_raised")
        if isinstance(value, ToolOutcome):
            return value
        if isinstance(value, str):
            return ToolOutcome(value)
        # A large value is serialised in a thread: the loop keeps the heartbeats going.
        return await asyncio.to_thread(self._render, value)

    def _render(self, value: Any) -> ToolOutcome:
        try:
            return ToolOutcome(json.dumps(value, ensure_ascii=False, default=str))
        except (TypeError, ValueError) as exc:
            return ToolOutcome(f"{self.name} returned a value that is not JSON: {exc}", True,
                               "client_tool_raised")


@overload
def tool(fn: Callable[..., Any], /) -> ClientTool: ...


@overload
def tool(*, name: str | None = None, description: str | None = None,
         parameters: dict[str, Any] | None = None
         ) -> Callable[[Callable[..., Any]], ClientTool]: ...


def tool(fn: Callable[..., Any] | None = None, /, *, name: str | None = None,
         description: str | None = None, parameters: dict[str, Any] | None = None,
         ) -> ClientTool | Callable[[Callable[..., Any]], ClientTool]:
    """Make a client tool of a function: ``@tool`` or ``@tool(name=..., parameters=...)``.

    The function may be sync or async; it gets the model's arguments as keyword
    arguments and returns a ``str`` (what the model reads), any JSON value, or a
    ``ToolOutcome``."""

    def make(f: Callable[..., Any]) -> ClientTool:
        return ClientTool(name or f.__name__, description or _description(f),
                          parameters if parameters is not None else schema_from_hints(f), f)

    return make(fn) if fn is not None else make

