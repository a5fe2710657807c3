"""``[farm] backend_tcp`` in corral.toml: the farm's broker also binds a CURVE
tcp:// backend; a remote ``corral worker`` joins it beside the farm's own ipc://
workers, and rejoins on the same port after the broker is killed and restarted."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from supervisor.client import SupervisorClient
from supervisor.farm.root import Farm
from supervisor.keys import allow, farm_keys, new_key
from tests.helpers import Procs, eventually
from tests.multihost import farm as mh

pytestmark = pytest.mark.timeout(150)


async def _worker_pids(sv: SupervisorClient) -> set[int]:
    broker = (await sv.call("status"))["broker"]
    return {int(w["info"]["pid"]) for svc in broker.get("workers", {}).values()
            for w in svc.get("workers", []) if "pid" in (w.get("info") or {})}


async def test_farm_backend_tcp_takes_a_remote_worker(procs: Procs, tmp_path: Path) -> None:
    home = tmp_path / "home"
    mh.make_home(home, workers=())
    toml = home / "corral.toml"
    toml.write_text(toml.read_text() + '[farm]\nworkers = 1\nbackend_tcp = "127.0.0.1:0"\n')
    farm = Farm(home, workers=1)
    ready = asyncio.Event()
    task = asyncio.create_task(farm.tree.run(on_ready=ready.set))
    try:
        async with asyncio.timeout(90):
            await ready.wait()
        broker_ready: dict[str, Any] = farm.tree.children["broker"].ready
        tcp_backend = broker_ready["tcp"]["backend"]
        assert tcp_backend.startswith("tcp://127.0.0.1:")
        fk = farm_keys(home)
        assert fk.secret("broker").stat().st_mode & 0o777 == 0o600
        new_key("remote", fk.directory)
        allow(fk.public("remote"), home, role="worker")
        remote = mh.Farm(home, procs).worker("remote", tcp_backend)
        async with SupervisorClient(farm.paths.supervisor_endpoint) as sv:
            pids = await eventually(lambda: _two(sv), timeout_s=30, what="two workers")
            assert int(remote["pid"]) in pids
            old_pid = farm.tree.children["broker"].pid
            assert old_pid is not None
            os.kill(old_pid, signal.SIGKILL)

            async def back_again() -> bool:
                if farm.tree.children["broker"].pid in (None, old_pid):
                    return False
                with contextlib.suppress(Exception):
                    return int(remote["pid"]) in await _worker_pids(sv)
                return False

            await eventually(back_again, timeout_s=60, what="remote worker re-registered")
            assert farm.tree.children["broker"].ready["tcp"]["backend"] == tcp_backend
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


async def _two(sv: SupervisorClient) -> set[int] | None:
    pids = await _worker_pids(sv)
    return pids if len(pids) == 2 else None
