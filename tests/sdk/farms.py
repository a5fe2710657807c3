"""Embedded farms for the SDK tests: started, and stopped with a by-pid sweep."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from supervisor.sdk import EmbeddedFarm
from tests.helpers import kill_tree

# The model of every session in these modules: a client tool call, then text;
# a second turn does the same (the scripted provider picks entry k, the count
# of model outputs already in the request).
PROBE_SCRIPT: dict[str, Any] = {"responses": [
    {"tool_calls": [{"name": "probe", "arguments": {"x": 1}}]},
    {"text": "done"},
    {"tool_calls": [{"name": "probe", "arguments": {"x": 2}}]},
    {"text": "done again"},
    {"text": "spare"},
]}


@contextlib.asynccontextmanager
async def running_farm(**kwargs: Any) -> AsyncIterator[EmbeddedFarm]:
    farm = EmbeddedFarm(**kwargs)
    pids: list[int] = []
    try:
        async with farm:
            pids.extend(farm.pids().values())
            yield farm
    finally:
        for pid in pids:  # stopped in order by the farm; this only catches leaks
            kill_tree(pid)
