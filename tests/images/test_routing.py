"""Images across workers, with a real broker and real T2 workers: a call of a
session in an image goes to a worker that holds it (``tool@img-...``, the
broker's pinned-service routing), a worker that lacks it fetches it from the
farm's store on shared storage, and a worker that cannot run images fails the
call with a typed error (never on its own root); the supervisor refuses such a
session at creation when no worker can run images."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker.client import BrokerClient
from sandbox_worker.api import ToolCallRequest, image_service
from supervisor.engine.calls import call_tool
from supervisor.images.session import resolve_image
from supervisor.images.store import ImageStore
from supervisor.server import CallError
from supervisor.wire import ErrorKind
from tests.helpers import Procs, eventually, read_line_with_deadline, searchable_dir
from tests.images.real import MARKER, busybox_image, need_tools
from tests.sandbox.conftest import HB_S, stop_all

pytestmark = pytest.mark.timeout(150)


def start_broker(procs: Procs, ipc: Path) -> str:
    broker = procs.python("broker", "--frontend", f"ipc://{ipc}/f", "--backend",
                          f"ipc://{ipc}/b", "--heartbeat-interval-s", str(HB_S),
                          "--liveness", "4", name="broker", stdout=subprocess.PIPE)
    read_line_with_deadline(broker, 20.0)
    return f"ipc://{ipc}"


def start_worker(procs: Procs, ipc: str, name: str, *args: str) -> dict[str, Any]:
    """The worker's READY info for its tool service (its process as ``["proc"]``)."""
    worker = procs.python("sandbox_worker", "--broker", f"{ipc}/b", "--services", "tool",
                          "--capacity", "4", "--heartbeat-interval-s", str(HB_S),
                          "--liveness", "4", *args, name=name, stdout=subprocess.PIPE)
    try:
        info = dict(json.loads(read_line_with_deadline(worker, 40.0))["info"]["tool"])
        return {**info, "proc": worker}
    except AssertionError as exc:
        raise AssertionError(f"worker {name} did not start: {procs.log(worker)}") from exc


def request(digest: str, ws: Path, command: str) -> ToolCallRequest:
    return ToolCallRequest(call_id=f"c-{os.urandom(6).hex()}", tool="shell",
                           arguments={"command": command}, session_id="s-img",
                           workspace=str(ws), policy={"image": digest})


async def wait_workers(client: BrokerClient, n: int) -> None:
    async def registered() -> bool:
        return bool((await client.status())["worker_count"] == n)

    await eventually(registered, timeout_s=20, what=f"{n} registered workers")


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[Path, str, Path]]:
    need_tools()
    os.chmod(tmp_path, 0o755)
    home = tmp_path / "home"
    digest = ImageStore(home).import_image(busybox_image(tmp_path / "bb"), "bb").digest
    with searchable_dir("corral-img-ws-", "/tmp") as ws:
        yield home, digest, ws


async def test_calls_go_to_a_worker_holding_the_image(setup: tuple[Path, str, Path],
                                                      tmp_path: Path) -> None:
    home, digest, ws = setup
    empty = tmp_path / "empty-store"
    empty.mkdir()
    procs = Procs(tmp_path)
    try:
        ipc = start_broker(procs, tmp_path)
        holds = start_worker(procs, ipc, "holds", "--images", str(home / "images"))
        lacks = start_worker(procs, ipc, "lacks", "--images", str(empty))
        assert holds["images"]["held"] == [digest]
        assert lacks["images"]["held"] == []
        async with BrokerClient(f"{ipc}/f", heartbeat_interval_s=HB_S) as client:
            # Eight at once over two workers of capacity 4: plain 'tool' would
            # give the one without the image its share.
            results = await asyncio.gather(*(
                call_tool(client, request(digest, ws, "cat /etc/corral-marker"), budget_s=60)
                for _ in range(8)))
            for r in results:
                assert r["outcome"] == "ok", r["output"]
                assert r["output"] == MARKER
                assert r["isolation"]["image"]["digest"] == digest
            # Without the holder, the call goes to 'tool' (its name is unroutable)
            # and the worker that lacks the image refuses it: never another root.
            holds["proc"].terminate()
            holds["proc"].wait(15)
            await wait_workers(client, 1)
            r = await call_tool(client, request(digest, ws, "echo RAN"), budget_s=60)
            assert r["error_kind"] == "image_unavailable"
            assert "RAN" not in r["output"]
    finally:
        stop_all(procs)


async def test_fetch_from_shared_store_and_refusals(setup: tuple[Path, str, Path],
                                                    tmp_path: Path) -> None:
    home, digest, ws = setup
    cache = tmp_path / "cache"
    cache.mkdir()
    procs = Procs(tmp_path)
    try:
        ipc = start_broker(procs, tmp_path)
        off = start_worker(procs, ipc, "off", "--no-images")
        assert off["images"]["overlay"] is False
        async with BrokerClient(f"{ipc}/f", heartbeat_interval_s=HB_S) as client:
            # Session creation: refused while no registered worker can run images.
            with pytest.raises(CallError) as refused:
                await resolve_image("bb", home, client)
            assert refused.value.kind == ErrorKind.IMAGES_UNSUPPORTED
            with pytest.raises(CallError) as missing:
                await resolve_image("no-such-image", home, client)
            assert missing.value.kind == ErrorKind.IMAGE_NOT_FOUND
            # A call that reaches it anyway fails typed, and nothing ran.
            r = await call_tool(client, request(digest, ws, "echo RAN"), budget_s=60)
            assert r["error_kind"] == "image_unavailable"
            assert r["exit_code"] is None
            procs.kill_all()
            procs.started.clear()
        (tmp_path / "b2").mkdir()
        ipc = start_broker(procs, tmp_path / "b2")
        fetcher = start_worker(procs, ipc, "fetcher", "--images", str(cache),
                               "--image-source", str(home / "images"))
        assert fetcher["images"]["held"] == []
        async with BrokerClient(f"{ipc}/f", heartbeat_interval_s=HB_S) as client:
            assert await resolve_image("bb", home, client) == digest
            r = await call_tool(client, request(digest, ws, "cat /etc/corral-marker"),
                                budget_s=60)
            assert r["outcome"] == "ok", r["output"]
            assert r["output"] == MARKER
            assert r["isolation"]["image"]["digest"] == digest
        assert (cache / "sha256" / digest.removeprefix("sha256:") / "rootfs/etc/corral-marker"
                ).read_text() == MARKER
        assert image_service(digest).startswith("tool@img-")
    finally:
        stop_all(procs)
