"""A whole farm (the same supervision tree ``corral up`` runs) for a test, and what
the other farm fixtures (tests/telemetry, tests/crash) share: the farm's home
(``write_home``), its handle (``RunningFarm``) and its stop (``stop_farms``)."""

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


@dataclass
class RunningFarm:
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
        """The child's ready line (its endpoints, its web and metrics URLs)."""
        return dict(self.farm.tree.children[name].ready or {})


def write_home(home: Path, script: dict[str, Any], *, extra: str = "") -> None:
    home.mkdir(parents=True, exist_ok=True)
    (home / "script.json").write_text(json.dumps(script))
    (home / "corral.toml").write_text(
        '[session]\ndefault_route = "s"\napproval = "allow"\n'
        '[routes.s]\nscript = "script.json"\nread_timeout_s = 5.0\n' + extra)


async def stop_farms(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel each farm's task and wait for it: the tree reaps every child."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


@pytest.fixture
async def start_farm(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """``await start_farm(script, workers=2)`` → a serving farm, stopped afterwards."""
    tasks: list[asyncio.Task[None]] = []

    async def start(script: dict[str, Any], *, workers: int = 2, extra: str = "",
                    home: Path | None = None) -> RunningFarm:
        home = home or tmp_path / "home"
        write_home(home, script, extra=extra)
        farm = Farm(home, workers=workers)
        ready = asyncio.Event()
        task = asyncio.create_task(farm.tree.run(on_ready=ready.set))
        tasks.append(task)
        waiter = asyncio.create_task(ready.wait())
        done, _ = await asyncio.wait({task, waiter}, timeout=90,
                                     return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()
        if waiter not in done:
            waiter.cancel()
            raise AssertionError("the farm did not get ready within 90 s")
        return RunningFarm(farm, home)

    try:
        yield start
    finally:
        await stop_farms(tasks)
