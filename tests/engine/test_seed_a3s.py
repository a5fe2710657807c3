"""The 5 A3S checkpoint-export scenarios (seeds/003), in our terms.

A tool boundary is a completed tool round of a turn; the run is the turn. The
sinks here are host-provided objects with ``async export(doc)`` (recording,
failing, blocking), as in the seed.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from supervisor.export import DirectorySink, load_loop_checkpoint
from supervisor.export.checkpoint import find_run, verify
from tests.engine.farm import Farm, FarmPool, engine
from tests.helpers import Procs

# The farms' brokers and workers are shared by the module (conftest.py's
# ``farm_pool``), also under xdist (--dist loadgroup).
pytestmark = [pytest.mark.sandbox, pytest.mark.xdist_group("engine-a3s")]


class RecordingSink:
    name = "recording"

    def __init__(self, fail: bool = False) -> None:
        self.exports: list[dict[str, Any]] = []
        self.fail = fail

    async def export(self, doc: dict[str, Any]) -> None:
        self.exports.append(doc)
        if self.fail:
            raise RuntimeError("deterministic export failure")


class BlockingSink:
    name = "blocking"

    def __init__(self) -> None:
        self.exports: list[dict[str, Any]] = []
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def export(self, doc: dict[str, Any]) -> None:
        self.exports.append(doc)
        self.entered.set()
        await self.release.wait()


def read_call(call_id: str, path: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "read_file", "call_id": call_id,
                            "arguments": {"path": path}}]}


FINAL = {"text": "boundary export complete"}


def farm_with(pool: FarmPool, procs: Procs, tmp: Path, responses: list[dict[str, Any]],
              files: dict[str, str]) -> Farm:
    farm = pool.farm(procs, tmp, {"responses": responses})
    for name, text in files.items():
        (farm.ws / name).write_text(text)
    return farm


def tool_end_ids(run: dict[str, Any]) -> list[str]:
    return [e["payload"]["call_id"] for e in run["events"] if e["type"] == "tool_call_end"]


async def test_live_tool_boundary_exports_one_self_consistent_portable_checkpoint(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    farm = farm_with(farm_pool, procs, tmp_path,
                     [read_call("read-boundary-1", "evidence.txt"), FINAL],
                     {"evidence.txt": "same-boundary evidence\n"})
    sink = RecordingSink()
    async with engine(farm, export_sinks=[sink]) as eng:
        sid = await eng.session(approval={"default": "ask", "allow": ["read_file(*)"]})
        events = await eng.run_until(sid, {"type": "user_input", "text": "read the evidence"})
        assert events[-1].type == "turn_complete"
        assert events[-1].payload["last_agent_message"] == "boundary export complete"
        assert len(sink.exports) == 1
        doc = sink.exports[0]
        assert verify(doc) == []
        logical = doc["content"]["logical_resume"]
        assert logical["session_id"] == sid
        assert logical["turn"] == 1
        assert any(m.get("type") == "function_call_output" for m in logical["messages"])
        run = find_run(doc, logical["run_id"])
        assert run is not None, "the same snapshot must contain the source run"
        assert run["snapshot"]["capability_binding"] == logical["capability_binding"]
        assert run["snapshot"]["status"] not in ("completed", "aborted", "failed")
        assert "read-boundary-1" in tool_end_ids(run)


async def test_successive_tool_boundaries_form_an_ordered_checkpoint_series(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    farm = farm_with(farm_pool, procs, tmp_path, [read_call("read-boundary-1", "first.txt"),
                                       read_call("read-boundary-2", "second.txt"), FINAL],
                     {"first.txt": "first boundary\n", "second.txt": "second boundary\n"})
    sink = RecordingSink()
    async with engine(farm, export_sinks=[sink]) as eng:
        sid = await eng.session()
        events = await eng.run_until(sid, {"type": "user_input", "text": "read both files"})
        assert events[-1].type == "turn_complete"
        execution = (await eng.store.executions_page(sid, limit=1)).items[0]
        assert execution.tool_calls == 2
        assert len(sink.exports) == 2
        previous_count, previous_digest = 0, None
        for index, doc in enumerate(sink.exports):
            assert verify(doc) == []
            digest = doc["descriptor"]["digest"]
            assert digest != previous_digest
            previous_digest = digest
            logical = doc["content"]["logical_resume"]
            assert logical["turn"] == index + 1
            run = find_run(doc, logical["run_id"])
            assert run is not None
            assert run["snapshot"]["event_count"] > previous_count
            previous_count = run["snapshot"]["event_count"]
            assert f"read-boundary-{index + 1}" in tool_end_ids(run)


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non_streaming"])
async def test_streaming_runs_use_the_same_acknowledged_export_boundary(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path, stream: bool) -> None:
    farm = farm_with(farm_pool, procs, tmp_path, [read_call("stream-read-boundary", "evidence.txt"),
                                       FINAL], {"evidence.txt": "stream boundary\n"})
    sink = RecordingSink()
    async with engine(farm, export_sinks=[sink]) as eng:
        sid = await eng.session(stream=stream)
        events = await eng.run_until(sid, {"type": "user_input", "text": "read the evidence"})
        assert events[-1].type == "turn_complete"
        assert ("agent_message_delta" in [e.type for e in events]) == stream
        assert len(sink.exports) == 1
        doc = sink.exports[0]
        assert verify(doc) == []
        logical = doc["content"]["logical_resume"]
        run = find_run(doc, logical["run_id"])
        assert run is not None
        assert tool_end_ids(run) == ["stream-read-boundary"]
        # the boundary is the same whether or not the model streamed: the export
        # follows the round's tool_call_end, before the next model step starts
        kinds = [e["type"] for e in run["events"]]
        assert kinds[-1] == "tool_call_end"
        assert kinds.count("model_step_started") == 1


async def test_session_store_and_host_export_observe_the_same_live_boundary(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    farm = farm_with(farm_pool, procs, tmp_path,
                     [read_call("dual-sink-read", "evidence.txt"), FINAL],
                     {"evidence.txt": "dual sink boundary\n"})
    sink = BlockingSink()
    async with engine(farm, export_sinks=[sink]) as eng:
        sid = await eng.session()
        sub = await eng.manager.submit(sid, {"type": "user_input", "text": "read the evidence"})
        async with asyncio.timeout(20):
            await sink.entered.wait()
        exported = sink.exports[-1]
        stored = await load_loop_checkpoint(eng.store, sid)
        assert stored is not None, "the logical store write must precede the host export"
        assert stored["descriptor"] == exported["descriptor"]
        assert json.dumps(stored["content"]["logical_resume"], sort_keys=True) == json.dumps(
            exported["content"]["logical_resume"], sort_keys=True)
        sink.release.set()
        events = await eng.run_until(
            sid, None, until=lambda e: e.submission_id == sub and e.type == "turn_complete")
        assert events[-1].payload["last_agent_message"] == "boundary export complete"
        after = await eng.store.load(sid)
        assert after is not None
        assert after.state.export_loop_checkpoint is None
        assert await load_loop_checkpoint(eng.store, sid) is None


async def test_checkpoint_export_failure_is_observable_but_does_not_halt_the_live_run(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    farm = farm_with(farm_pool, procs, tmp_path,
                     [read_call("read-boundary-1", "evidence.txt"), FINAL],
                     {"evidence.txt": "evidence\n"})
    sink = RecordingSink(fail=True)
    async with engine(farm, export_sinks=[sink]) as eng:
        sid = await eng.session()
        events = await eng.run_until(sid, {"type": "user_input", "text": "read the evidence"})
        assert events[-1].type == "turn_complete"
        assert events[-1].payload["last_agent_message"] == "boundary export complete"
        assert len(sink.exports) == 1
        warning = next(e for e in events if e.type == "warning" and "export" in e.payload)
        assert warning.payload["export"]["sink"] == "recording"
        assert "deterministic export failure" in warning.payload["export"]["message"]
        assert warning.payload["export"]["digest"] == sink.exports[0]["descriptor"]["digest"]
        replay = await eng.store.replay_events(sid)
        assert any(e.type == "warning" and "export" in e.payload for e in replay)


async def test_directory_sink_gets_the_same_boundary_checkpoint(
        procs: Procs, farm_pool: FarmPool, tmp_path: Path) -> None:
    farm = farm_with(farm_pool, procs, tmp_path,
                     [read_call("read-boundary-1", "evidence.txt"), FINAL],
                     {"evidence.txt": "evidence\n"})
    recording = RecordingSink()
    out = tmp_path / "exports"
    async with engine(farm, export_sinks=[DirectorySink(out), recording]) as eng:
        sid = await eng.session()
        events = await eng.run_until(sid, {"type": "user_input", "text": "read the evidence"})
        assert events[-1].type == "turn_complete"
    files = sorted(out.glob("*.json"))
    assert len(files) == 1
    doc = json.loads(files[0].read_text())
    assert verify(doc) == []
    assert doc["descriptor"] == recording.exports[0]["descriptor"]
