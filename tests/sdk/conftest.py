"""One embedded farm per test module (``supervisor.sdk.EmbeddedFarm``: the
real broker, sandbox worker, supervisor and scripted provider processes),
stopped at the module's end; whatever survives is killed by pid."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from supervisor.sdk import EmbeddedFarm
from tests.helpers import searchable_dir
from tests.sdk.farms import PROBE_SCRIPT, running_farm


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def farm() -> AsyncIterator[EmbeddedFarm]:
    # INFO: test_sdk_turns reads the supervisor's log for a client it dropped
    async with running_farm(script=PROBE_SCRIPT, workers=1, log_level="INFO") as f:
        yield f


@pytest.fixture
def workspace() -> Iterator[Path]:
    with searchable_dir("corral-sdk-ws-", "/tmp") as path:
        yield path
