"""``corral worker`` over CURVE: registers with its host, tier and capacity, serves
sandboxed tool calls, and on SIGTERM finishes its in-flight call before leaving."""

from __future__ import annotations

import signal
from pathlib import Path

import msgpack
import pytest

from broker.client import BrokerClient
from supervisor.keys import farm_keys
from tests.helpers import Procs, eventually
from tests.multihost.farm import HB_S, LIVENESS, Farm, make_home

pytestmark = pytest.mark.timeout(120)


def _tool_body(workspace: Path, command: str) -> bytes:
    return bytes(msgpack.packb({"call_id": "c1", "tool": "shell",
                                "arguments": {"command": command}, "session_id": "s1",
                                "workspace": str(workspace)}))


async def test_remote_worker_registers_serves_and_drains(procs: Procs, tmp_path: Path,
                                                         workspace_root: Path) -> None:
    home = make_home(tmp_path / "home", workers=("w1",))
    farm = Farm(home, procs)
    b = farm.broker("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    farm.worker("w1", b["backend"], capacity=3)
    worker = farm.proc["w1"]
    fk = farm_keys(home)
    from broker.security import CurveClient

    curve = CurveClient.from_files(fk.public("broker"), fk.secret("supervisor"))
    ws = workspace_root / "ws"
    ws.mkdir()
    async with BrokerClient(b["frontend"], curve=curve, heartbeat_interval_s=HB_S,
                            liveness=LIVENESS) as client:
        status = await client.status()
        entry = status["workers"]["tool"]["workers"][0]
        assert entry["capacity"] == 3
        assert entry["info"]["capacity"] == 3
        assert entry["info"]["host"]
        assert entry["info"]["tool"]["tier"] in ("T2", "T2-", "T1")

        call = client.start("tool", _tool_body(ws, "echo started > s.txt; sleep 2; echo done"),
                            budget_s=60)

        async def started() -> bool:
            return (ws / "s.txt").exists()

        await eventually(started, timeout_s=30, what="the tool call running")
        worker.send_signal(signal.SIGTERM)  # drain: the call in flight finishes
        result = msgpack.unpackb(await call.result())
        assert result["outcome"] == "ok", result
        assert worker.wait(timeout=30) == 0

        async def gone() -> bool:
            return (await client.status())["worker_count"] == 0

        await eventually(gone, timeout_s=10, what="the worker said DISCONNECT")
