"""One embedded farm per test module (``supervisor.sdk.EmbeddedFarm``: the
real broker, sandbox worker, supervisor and scripted provider processes),
stopped at the module's end; whatever survives is killed by pid."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from supervisor.sdk import EmbeddedFarm
from tests.helpers import kill_tree, searchable_dir

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


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def farm() -> AsyncIterator[EmbeddedFarm]:
    async with running_farm(script=PROBE_SCRIPT, workers=1) as f:
        yield f


@pytest.fixture
def workspace() -> Iterator[Path]:
    with searchable_dir("corral-sdk-ws-", "/tmp") as path:
        yield path
