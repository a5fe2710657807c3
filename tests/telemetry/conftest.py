"""A whole farm with telemetry on, as ``corral up`` runs it (``Farm.run``, so
HOME/farm.json is kept true), for the telemetry tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from supervisor.farm.root import Farm
from tests.helpers import eventually


@dataclass
class TelemetryFarm:
    farm: Farm
    home: Path

    @property
    def endpoint(self) -> str:
        return self.farm.paths.supervisor_endpoint

    def pid(self, name: str) -> int:
        pid = self.farm.tree.children[name].pid
        assert pid is not None
        return pid

    def ready(self, name: str = "supervisor") -> dict[str, Any]:
        return dict(self.farm.tree.children[name].ready or {})


@pytest.fixture
async def telemetry_farm(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """``await telemetry_farm(script, extra=TOML)`` → a serving farm; stopped (every
    child reaped by the tree) afterwards."""
    tasks: list[asyncio.Task[None]] = []

    async def start(script: dict[str, Any], *, workers: int = 2, extra: str = "",
                    **farm_kw: Any) -> TelemetryFarm:
        home = tmp_path / "home"
        home.mkdir(parents=True, exist_ok=True)
        (home / "script.json").write_text(json.dumps(script))
        (home / "corral.toml").write_text(
            '[session]\ndefault_route = "s"\napproval = "allow"\n'
            '[routes.s]\nscript = "script.json"\nread_timeout_s = 5.0\n' + extra)
        farm = Farm(home, workers=workers, **farm_kw)
        task = asyncio.create_task(farm.run())
        tasks.append(task)

        async def serving() -> bool:
            if task.done():
                task.result()
            return farm.serving

        await eventually(serving, timeout_s=90, what="the farm to serve")
        return TelemetryFarm(farm, home)

    try:
        yield start
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
