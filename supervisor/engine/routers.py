"""Routers for tool calls that leave the engine without going to the sandboxed
``tool`` service: the one registry ``calls.call_tool`` asks first.

The supervisor process registers a router at start (``supervisor/clienttools.py``
routes the tools of client programs back to the program that registered
them). ``call_tool`` asks each router, in registration order, whether it takes
a request; the first that does runs it and answers with a ``ToolCallResult``
or raises ``CallFailed``, exactly as the broker path does, so the tool round,
approvals, hooks, events, records and export treat the call as any other.

Invariants:
- Only names outside ``sandbox_worker.api.TOOL_NAMES`` are ever routed: a
  built-in tool always runs in the sandbox.
- A router that takes a request owns its deadline (``budget_s``) and its
  cancellation (``CancelledError`` is re-raised after bounded cleanup).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from sandbox_worker.api import TOOL_NAMES, ToolCallRequest, ToolCallResult


class ToolRouter(Protocol):
    async def routes(self, request: ToolCallRequest) -> bool:
        """Whether this router runs ``request`` (may read the store)."""
        ...

    async def call(self, request: ToolCallRequest, *, budget_s: float,
                   on_partial: Callable[[Any], Awaitable[None]] | None = None
                   ) -> ToolCallResult:
        """Run the call within ``budget_s``; ``CallFailed`` when it cannot."""
        ...


_ROUTERS: list[ToolRouter] = []


def add_router(router: ToolRouter) -> None:
    if router not in _ROUTERS:
        _ROUTERS.append(router)


def remove_router(router: ToolRouter) -> None:
    if router in _ROUTERS:
        _ROUTERS.remove(router)


async def find_router(request: ToolCallRequest) -> ToolRouter | None:
    """The router that takes ``request``, or None (the request goes to the broker)."""
    if request.get("tool") in TOOL_NAMES:
        return None
    for router in list(_ROUTERS):
        if await router.routes(request):
            return router
    return None
