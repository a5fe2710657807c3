"""A whole farm with telemetry on, as ``corral up`` runs it (``Farm.run``, so
HOME/farm.json is kept true), for the telemetry tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from supervisor.farm.root import Farm
from tests.farm.conftest import RunningFarm, stop_farms, write_home
from tests.helpers import eventually


@pytest.fixture
async def telemetry_farm(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """``await telemetry_farm(script, extra=TOML)`` → a serving farm; stopped (every
    child reaped by the tree) afterwards."""
    tasks: list[asyncio.Task[None]] = []

    async def start(script: dict[str, Any], *, workers: int = 2, extra: str = "",
                    **farm_kw: Any) -> RunningFarm:
        home = tmp_path / "home"
        write_home(home, script, extra=extra)
        farm = Farm(home, workers=workers, **farm_kw)
        task = asyncio.create_task(farm.run())
        tasks.append(task)

        async def serving() -> bool:
            if task.done():
                task.result()
            return farm.serving

        await eventually(serving, timeout_s=90, what="the farm to serve")
        return RunningFarm(farm, home)

    try:
        yield start
    finally:
        await stop_farms(tasks)
