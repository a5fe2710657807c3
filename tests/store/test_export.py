"""Portable checkpoints: build from a real store, verify, tamper, sinks (a real
directory, a real HTTP server on loopback), import into a fresh store, loop reference."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from supervisor.export import (
    BindingMismatch,
    CheckpointInvalid,
    DirectorySink,
    HttpSink,
    SinkError,
    build_checkpoint,
    capability_binding,
    export_to_sinks,
    file_name,
    import_checkpoint,
    load_loop_checkpoint,
    loop_reference,
    verify,
)
from supervisor.export.checkpoint import seal
from supervisor.store import EventRecord, SessionId, SessionStore, Store
from tests.store.backends import open_backend
from tests.store.steps import Session, execution, new_record, tool_round

TOOLS = [
    {"name": "read_file", "description": "read", "parameters": {"type": "object"},
     "idempotent": True, "read_only": True},
    {"name": "shell", "description": "run", "parameters": {"type": "object"},
     "idempotent": False, "read_only": False},
]
POLICY = {"approval": "never", "allow": ["read_file(*)"]}
BINDING = capability_binding(TOOLS, POLICY)


async def _run_rounds(store: SessionStore, s: Session, rounds: int) -> list[dict[str, Any]]:
    """A run (turn "run-1") with ``rounds`` tool rounds; returns one checkpoint per round."""
    docs = []
    events: list[EventRecord] = []

    async def commit(**kw: Any) -> None:
        step = s.step(**kw)
        await store.commit(step)
        events.extend(step.events)

    await commit(items=[{"type": "message", "role": "user",
                         "content": [{"type": "input_text", "text": "read the evidence"}]}],
                 events=[("turn_started", {"turn_id": "run-1"})],
                 execution=execution("live", "run-1", "running", model_calls=0))
    for r in range(1, rounds + 1):
        call = f"read-boundary-{r}"
        await commit(items=[{"type": "function_call", "call_id": call, "name": "read_file",
                             "arguments": json.dumps({"path": f"f{r}.txt"})}],
                     events=[("model_step_completed", {"step": r}),
                             ("tool_call_begin", {"call_id": call})])
        await commit(items=[{"type": "function_call_output", "call_id": call,
                             "output": f"evidence {r}\n"}],
                     events=[("tool_call_end", {"call_id": call, "output": f"evidence {r}"})],
                     execution=execution("live", "run-1", "running", model_calls=r,
                                         tool_calls=r))
        loaded = await store.load(s.id)
        assert loaded is not None
        page = await store.executions_page(s.id, limit=1)
        docs.append(build_checkpoint(
            session_id=s.id, run_id="run-1", turn=r, messages=loaded.context,
            usage={"input": r, "cached_input": 0, "cache_write_input": 0, "output": r,
                   "reasoning_output": 0, "total": 2 * r},
            binding=BINDING, tool_rounds=[[f"read-boundary-{i}"] for i in range(1, r + 1)],
            execution=page.items[0], events=list(events),
            epoch=loaded.state.context_epoch, at_batch=loaded.last_batch_sequence,
        ))
    return docs


@pytest.fixture
async def series(sqlite_store: Store) -> list[dict[str, Any]]:
    s = Session("live")
    await sqlite_store.create_session(new_record("live"))
    return await _run_rounds(sqlite_store, s, 2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("source", "target"), [("sqlite", "postgresql"),
                                                ("postgresql", "sqlite")])
async def test_exports_verify_across_the_two_stores(
    request: pytest.FixtureRequest, tmp_path: Path, source: str, target: str
) -> None:
    """SQLite -> export -> import on PostgreSQL, and back: the document built from one
    store verifies, rebuilds identically from its reference, and resumes on the other."""
    src = await open_backend(request, source, tmp_path / "src")
    dst = await open_backend(request, target, tmp_path / "dst")
    try:
        s = Session("live")
        await src.create_session(new_record("live"))
        docs = await _run_rounds(src, s, 2)
        s.state.export_loop_checkpoint = loop_reference(docs[-1])
        await src.commit(s.step())
        assert await load_loop_checkpoint(src, SessionId("live")) == docs[-1]
        await DirectorySink(tmp_path / "out").export(docs[-1])
        (written,) = (tmp_path / "out").iterdir()
        doc = json.loads(written.read_bytes())
        assert verify(doc) == []
        record = await import_checkpoint(dst, doc, expected_binding=BINDING,
                                         config={"route": "main"})
        original, imported = await src.load(s.id), await dst.load(record.session_id)
        assert original is not None
        assert imported is not None
        assert imported.context == original.context == \
            doc["content"]["logical_resume"]["messages"]
        assert imported.state.total_usage["total"] == 4
        await dst.commit(Session("live").step(tool_round(9)))
        again = await dst.load(SessionId("live"))
        assert again is not None
        assert again.context == original.context + tool_round(9)
    finally:
        await src.close()
        await dst.close()


def test_binding_is_by_schema_digest_and_sorted() -> None:
    assert [t["name"] for t in BINDING["tools"]] == ["read_file", "shell"]
    other = capability_binding([{**TOOLS[0], "description": "changed"}, TOOLS[1]], POLICY)
    assert other["tools"][0]["schema_digest"] != BINDING["tools"][0]["schema_digest"]
    assert capability_binding(list(reversed(TOOLS)), POLICY) == BINDING
    assert capability_binding(TOOLS, {**POLICY, "approval": "always"})["policy_digest"] \
        != BINDING["policy_digest"]


def test_binding_names_mcp_servers_and_client_tools_only_when_there_are_any() -> None:
    assert set(BINDING) == {"tools", "policy_digest"}  # as older checkpoints have it
    assert capability_binding(TOOLS, POLICY, mcp_servers={}, client_tools=[]) == BINDING
    full = capability_binding(TOOLS, POLICY, mcp_servers={"z": {"url": "u"}, "a": {"url": "v"}},
                              client_tools=[{"name": "w", "parameters": {}}])
    assert [e["name"] for e in full["mcp_servers"]] == ["a", "z"]
    assert full["client_tools"][0]["name"] == "w"
    moved = capability_binding(TOOLS, POLICY, mcp_servers={"z": {"url": "x"}, "a": {"url": "v"}})
    assert moved["mcp_servers"][1]["spec_digest"] != full["mcp_servers"][1]["spec_digest"]


async def test_series_verifies_and_is_ordered(series: list[dict[str, Any]]) -> None:
    first, second = series
    assert verify(first) == []
    assert verify(second) == []
    assert first["descriptor"]["turn"] == 1
    assert second["descriptor"]["turn"] == 2
    assert first["descriptor"]["digest"] != second["descriptor"]["digest"]
    counts = [d["content"]["snapshot"]["run_records"][0]["snapshot"]["event_count"]
              for d in series]
    assert counts[0] < counts[1]
    logical = first["content"]["logical_resume"]
    assert logical["session_id"] == "live"
    assert any(m["type"] == "function_call_output" for m in logical["messages"])
    run = first["content"]["snapshot"]["run_records"][0]
    assert run["snapshot"]["id"] == logical["run_id"]
    assert run["snapshot"]["status"] == "running"
    assert run["snapshot"]["capability_binding"] == logical["capability_binding"]
    assert any(e["type"] == "tool_call_end" and e["payload"]["call_id"] == "read-boundary-1"
               for e in run["events"])
    # Same content, same digest: the digest identifies content.
    assert seal(json.loads(json.dumps(first["content"])))["descriptor"] == first["descriptor"]


async def test_a_file_edited_by_one_byte_fails_verify(
    series: list[dict[str, Any]], tmp_path: Path
) -> None:
    out = tmp_path / "exports"
    await DirectorySink(out).export(series[0])
    (path,) = list(out.iterdir())
    assert verify(json.loads(path.read_bytes())) == []
    data = bytearray(path.read_bytes())
    at = data.index(b"evidence 1")
    data[at] = ord("E")  # one byte, still valid JSON
    assert verify(json.loads(bytes(data))) == ["digest does not match the content"]


def _mutated(doc: dict[str, Any], edit: Any) -> dict[str, Any]:
    """Apply ``edit`` to a copy's content, then re-seal so only the rule under test fails."""
    content = json.loads(json.dumps(doc["content"]))
    edit(content)
    return seal(content)


async def test_verify_rules(series: list[dict[str, Any]]) -> None:
    doc = series[1]
    run = ("snapshot", "run_records")

    def events(c: dict[str, Any]) -> list[dict[str, Any]]:
        return c[run[0]][run[1]][0]["events"]  # type: ignore[no-any-return]

    def snap(c: dict[str, Any]) -> dict[str, Any]:
        return c[run[0]][run[1]][0]["snapshot"]  # type: ignore[no-any-return]

    cases: list[tuple[Any, str]] = [
        (lambda c: snap(c).update(capability_binding=capability_binding(TOOLS[:1], POLICY)),
         "capability binding differs"),
        (lambda c: snap(c).update(status="completed"), "terminal"),
        (lambda c: [b.update(mcp_servers=[{"name": "t"}]) for b in (
            c["logical_resume"]["capability_binding"], snap(c)["capability_binding"])],
         "binding mcp_servers must be"),
        (lambda c: [b.update(client_tools=[{"name": n, "schema_digest": BINDING[
            "policy_digest"]} for n in ("b", "a")]) for b in (
            c["logical_resume"]["capability_binding"], snap(c)["capability_binding"])],
         "client_tools must be sorted"),
        (lambda c: snap(c).update(id="other-run"), "no run record"),
        (lambda c: events(c).pop(2), "not dense"),
        (lambda c: snap(c).update(event_count=99), "event_count"),
        (lambda c: c["logical_resume"].update(turn=3), "tool rounds are recorded"),
        (lambda c: c["logical_resume"]["tool_rounds"][1]["call_ids"].append("ghost"),
         "no tool_call_end"),
        (lambda c: c["logical_resume"].update(messages=[]), "no function_call_output"),
    ]
    for edit, expected in cases:
        problems = verify(_mutated(doc, edit))
        assert any(expected in p for p in problems), (expected, problems)
    wrong_size = json.loads(json.dumps(doc))
    wrong_size["descriptor"]["size"] += 1
    assert any("size" in p for p in verify(wrong_size))
    newer = json.loads(json.dumps(doc))
    newer["descriptor"]["version"] = 2
    assert any("unsupported version 2" in p for p in verify(newer))
    assert verify("not a document") == ["document is not a JSON object"]
    assert verify({"descriptor": {}}) != []


async def test_round_trip_into_a_fresh_store(series: list[dict[str, Any]], sqlite_store: Store,
                                             tmp_path: Path) -> None:
    store = sqlite_store
    out = tmp_path / "exports"
    sink = DirectorySink(out)
    for doc in series:
        await sink.export(doc)
    names = sorted(p.name for p in out.iterdir())
    digests = [d["descriptor"]["digest"][7:19] for d in series]
    assert names == [f"live-t0001-{digests[0]}.json", f"live-t0002-{digests[1]}.json"]
    doc = json.loads((out / names[1]).read_bytes())
    fresh = await Store.open(tmp_path / "fresh.db")
    try:
        record = await import_checkpoint(fresh, doc, expected_binding=BINDING,
                                         config={"route": "main"})
        assert record.session_id == "live"
        loaded = await fresh.load(SessionId("live"))
        original = await store.load(SessionId("live"))
        assert loaded is not None
        assert original is not None
        assert loaded.context == original.context
        assert loaded.context == doc["content"]["logical_resume"]["messages"]
        assert loaded.state.total_usage["total"] == 4
        assert loaded.record.config["imported_checkpoint"]["digest"] == doc["descriptor"]["digest"]
        # The imported session runs on from there.
        s = Session("live")
        await fresh.commit(s.step(tool_round(9)))
        again = await fresh.load(SessionId("live"))
        assert again is not None
        assert again.context == original.context + tool_round(9)
        # Under another id too.
        await import_checkpoint(fresh, doc, new_session_id=SessionId("copy"))
        copy = await fresh.load(SessionId("copy"))
        assert copy is not None
        assert copy.context == original.context
    finally:
        await fresh.close()


async def test_import_refuses_other_binding_and_bad_documents(
    series: list[dict[str, Any]], tmp_path: Path
) -> None:
    fresh = await Store.open(tmp_path / "fresh.db")
    try:
        other = capability_binding(TOOLS, {**POLICY, "allow": ["shell(*)"]})
        with pytest.raises(BindingMismatch):
            await import_checkpoint(fresh, series[0], expected_binding=other)
        tampered = json.loads(json.dumps(series[0]))
        tampered["content"]["logical_resume"]["messages"][0]["role"] = "system"
        with pytest.raises(CheckpointInvalid, match="digest"):
            await import_checkpoint(fresh, tampered)
        assert await fresh.load(SessionId("live")) is None
    finally:
        await fresh.close()


async def test_store_holds_the_checkpoint_under_export(series: list[dict[str, Any]],
                                                       sqlite_store: Store) -> None:
    store = sqlite_store
    doc = series[1]
    s = Session("live")
    loaded = await store.load(SessionId("live"))
    assert loaded is not None
    s.state = loaded.state
    ref = loop_reference(doc)
    s.state.export_loop_checkpoint = ref
    await store.commit(s.step())
    # By reference: no messages and no events are copied into the state row.
    assert "messages" not in ref["resume"]
    assert ref["events"] == {"first": 1, "last": 7}
    assert "evidence" not in json.dumps(ref)
    rebuilt = await load_loop_checkpoint(store, SessionId("live"))
    assert rebuilt == doc
    # A later step (the final answer) does not disturb it; completing the run clears it.
    await store.commit(s.step([{"type": "message", "role": "assistant",
                                "content": [{"type": "output_text", "text": "done"}]}]))
    assert await load_loop_checkpoint(store, SessionId("live")) == doc
    s.state.export_loop_checkpoint = None
    await store.commit(s.step())
    assert await load_loop_checkpoint(store, SessionId("live")) is None


class _Recorder(BaseHTTPRequestHandler):
    bodies: list[bytes]
    status: int
    release: threading.Event

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        if self.path == "/slow":
            self.release.wait(10)
        self.bodies.append(body)
        self.send_response(self.status)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def http_server() -> Iterator[tuple[str, type[_Recorder]]]:
    class Handler(_Recorder):
        bodies: list[bytes] = []  # one class per test: state is not shared
        status = 200
        release = threading.Event()

    handler = Handler
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        handler.release.set()
        server.shutdown()
        server.server_close()
        thread.join(10)


async def test_http_sink_posts_and_reports_failures(
    series: list[dict[str, Any]], http_server: tuple[str, type[_Recorder]]
) -> None:
    url, handler = http_server
    await HttpSink(url + "/ok", timeout_s=10).export(series[0])
    assert json.loads(handler.bodies[-1]) == series[0]
    handler.status = 503
    with pytest.raises(SinkError) as info:
        await HttpSink(url + "/ok", timeout_s=10).export(series[0])
    assert info.value.kind == "http_status"
    assert info.value.retryable
    handler.status = 400
    with pytest.raises(SinkError) as info:
        await HttpSink(url + "/ok", timeout_s=10).export(series[0])
    assert not info.value.retryable
    assert info.value.failure.as_data() == {"kind": "http_status", "retryable": False,
                                       "message": f"{url}/ok answered 400"}
    handler.status = 200
    with pytest.raises(SinkError) as info:
        await HttpSink(url + "/slow", timeout_s=0.3).export(series[0])
    assert info.value.kind == "timeout"
    handler.release.set()


async def test_http_sink_unreachable_is_a_sink_error(series: list[dict[str, Any]]) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    port = server.server_address[1]
    server.server_close()  # nothing listens there any more
    with pytest.raises(SinkError) as info:
        await HttpSink(f"http://127.0.0.1:{port}/", timeout_s=5).export(series[0])
    assert info.value.kind == "connect_error"


async def test_failing_sinks_are_collected_not_raised(series: list[dict[str, Any]],
                                                      tmp_path: Path) -> None:
    class Broken:
        async def export(self, doc: dict[str, Any]) -> None:
            raise RuntimeError("deterministic export failure")

    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the directory should be")
    good = DirectorySink(tmp_path / "good")
    failures = await export_to_sinks(series[0], [Broken(), DirectorySink(blocked), good])
    assert [f.kind for f in failures] == ["sink_error", "io_error"]
    assert "deterministic export failure" in str(failures[0])
    assert len(list((tmp_path / "good").iterdir())) == 1


async def test_directory_sink_leaves_no_temp_files(series: list[dict[str, Any]],
                                                   tmp_path: Path) -> None:
    sink = DirectorySink(tmp_path / "out")
    await asyncio.gather(*(sink.export(d) for d in series * 3))
    names = sorted(os.listdir(tmp_path / "out"))
    assert len(names) == 2
    assert not any(n.startswith(".") for n in names)
    with pytest.raises(SinkError, match="above"):
        await DirectorySink(tmp_path / "small", max_bytes=100).export(series[0])


def test_file_names_are_path_safe() -> None:
    doc = {"descriptor": {"session_id": "../../etc/passwd", "turn": 3,
                          "digest": "sha256:" + "ab" * 32}}
    name = file_name(doc)
    assert "/" not in name
    assert name == "_.._etc_passwd-t0003-abababababab.json"
