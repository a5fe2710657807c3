"""The small pure parts of telemetry: bounded labels, the traceparent parser,
and the [telemetry]/[web] config keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker import otel
from supervisor import config as config_mod
from supervisor.telemetry.labels import OTHER, Bounded
from supervisor.telemetry.setup import split_host_port

pytestmark = pytest.mark.timeout(30)


def test_bounded_labels_cap_distinct_values() -> None:
    b = Bounded(3, max_chars=8)
    assert [b(x) for x in ("a", "b", "c")] == ["a", "b", "c"]
    assert b("d") == OTHER
    assert b("a") == "a"
    assert Bounded(2)("bad label\n{x}") == "bad_label__x_"
    assert Bounded(2, max_chars=4)("abcdefgh") == "abcd"
    assert Bounded(2)(None) == "none"


def test_traceparent_is_parsed_strictly() -> None:
    tp = otel.format_traceparent(0xABC, 0xDEF)
    assert otel.parse_traceparent(tp) == (0xABC, 0xDEF, 1)
    for bad in (None, 5, "", tp + "x", tp.upper(), "01" + tp[2:],
                otel.format_traceparent(0, 1), otel.format_traceparent(1, 0),
                "00-" + "g" * 32 + "-" + "1" * 16 + "-01", "x" * 10_000):
        assert otel.parse_traceparent(bad) is None, bad


def test_host_port() -> None:
    assert split_host_port("127.0.0.1:0") == ("127.0.0.1", 0)
    assert split_host_port("[::1]:9464") == ("::1", 9464)
    for bad in ("9464", ":9464", "host:", "host:99999", "host:x"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            split_host_port(bad)


def test_telemetry_config(tmp_path: Path) -> None:
    (tmp_path / "corral.toml").write_text(
        '[telemetry]\nmetrics_listen = "127.0.0.1:9464"\n'
        'otlp_endpoint = "http://collector:4318"\nrecord_content = true\n'
        '[web]\nlisten = "0.0.0.0:8765"\n')
    cfg = config_mod.load(tmp_path)
    assert cfg.metrics_listen == "127.0.0.1:9464"
    assert cfg.otlp_endpoint == "http://collector:4318"
    assert cfg.record_content is True
    assert cfg.web_listen == "0.0.0.0:8765"
    assert config_mod.load(tmp_path / "none").metrics_listen is None
    for text, where in (('[telemetry]\nmetrics_listen = "9464"\n', "metrics_listen"),
                        ('[telemetry]\notlp_endpoint = "collector"\n', "otlp_endpoint"),
                        ('[telemetry]\nbogus = 1\n', "unknown key"),
                        ('[web]\nlisten = 8765\n', "web.listen")):
        (tmp_path / "corral.toml").write_text(text)
        with pytest.raises(config_mod.ConfigError, match=where):
            config_mod.load(tmp_path)


def test_a_restarted_supervisor_continues_the_turns_trace() -> None:
    """The tracer of a new supervisor process, fed the rest of a turn begun under
    the old one, reports its spans in the same trace (trace id from the turn id)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from supervisor.store.records import EventRecord, SessionId
    from supervisor.telemetry.tracing import SupervisorTracer, trace_id_of

    exporter = InMemorySpanExporter()

    def tracer() -> SupervisorTracer:
        t = SupervisorTracer(provider=TracerProvider())
        t.provider.add_span_processor(SimpleSpanProcessor(exporter))
        return t

    def event(type_: str, **payload: object) -> EventRecord:
        return EventRecord(SessionId("sess_1"), 1, type_, {"turn_id": "turn_7", **payload},
                           None, 1000.0)

    before = tracer()
    before.committed([event("turn_started")], 0.0)
    before.committed([event("tool_call_begin", call_id="c1", name="shell")], 0.0)
    # ... the supervisor is SIGKILLed; a new process resumes the turn.
    after = tracer()
    after.committed([event("tool_call_end", call_id="c1", name="shell", outcome="ok")], 0.0)
    after.committed([event("turn_complete")], 0.0)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["turn (resumed)"].context.trace_id == trace_id_of("turn_7")
    before_turn = before._turns["turn_7"].span.get_span_context()
    assert before_turn.trace_id == trace_id_of("turn_7")


def test_a_turn_sampled_out_costs_no_child_span() -> None:
    """Under a sampler that drops the turn, the tracer starts the turn's root
    span and nothing else, and every request carries the turn's unsampled
    context (flags 00) so the broker and the workers drop theirs too."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    from supervisor.store.records import EventRecord, SessionId
    from supervisor.telemetry.tracing import SupervisorTracer, trace_id_of

    t = SupervisorTracer(provider=TracerProvider(sampler=ParentBased(TraceIdRatioBased(0.0))))
    started: list[str] = []
    start_span = t.tracer.start_span

    def counting(name: str, *args: object, **kwargs: object) -> object:
        started.append(name)
        return start_span(name, *args, **kwargs)  # type: ignore[arg-type]
    t.tracer.start_span = counting  # type: ignore[method-assign]

    def event(type_: str, **payload: object) -> EventRecord:
        return EventRecord(SessionId("sess_1"), 1, type_, {"turn_id": "turn_9", **payload},
                           None, 1000.0)

    t.committed([event("turn_started")], 0.0)
    model = t.begin("model", {"session_id": "sess_1", "route": {"model": "m"}})
    t.committed([event("tool_call_begin", call_id="c1", name="shell")], 0.0)
    tool = t.begin("tool", {"call_id": "c1", "tool": "shell"})
    t.hook("audit", "pre_tool", "sess_1", "turn_9")(None)
    t.committed([event("exec_approval_request", id="a1")], 0.0)
    t.committed([event("tool_call_end", call_id="c1", name="shell", outcome="ok")], 0.0)
    t.committed([event("turn_complete")], 0.0)
    assert started == ["turn"]
    for sink in (model, tool):
        assert sink is not None
        assert sink.trace is not None
        assert otel.parse_traceparent(sink.trace)[::2] == (trace_id_of("turn_9"), 0)  # type: ignore[index]


def test_corral_up_says_where_telemetry_serves(tmp_path: Path) -> None:
    from supervisor.cli.lifecycle import telemetry_lines

    children = [{"name": "broker", "ready": {}},
                {"name": "supervisor", "ready": {"metrics": "http://127.0.0.1:9464/metrics",
                                                 "web": "http://127.0.0.1:8765/"}}]
    assert telemetry_lines(children, tmp_path) == [
        "metrics: http://127.0.0.1:9464/metrics", "web view: http://127.0.0.1:8765/"]
    (tmp_path / "web.token").write_text("t" * 43 + "\n")
    children[1]["ready"] = {"web": "http://0.0.0.0:8765/"}
    assert telemetry_lines(children, tmp_path) == [
        "web view: http://0.0.0.0:8765/?token=" + "t" * 43]
    assert telemetry_lines([{"name": "supervisor", "ready": None}], tmp_path) == []


def test_the_broker_reads_the_traceparent_from_the_payloads_end_only() -> None:
    from broker.protocol import pack

    tp = otel.format_traceparent(0xABC, 0xDEF)
    assert otel.traceparent_at_end(pack({"items": ["x" * 1000], "trace": tp})) == tp
    # Anywhere but last (a model's text holding one, say) is not a trace context.
    assert otel.traceparent_at_end(pack({"trace": tp, "items": []})) is None
    assert otel.traceparent_at_end(pack({"items": [{"trace": "x"}]})) is None
    assert otel.traceparent_at_end(pack({"items": ["say", tp]})) is None  # not the key
    assert otel.traceparent_at_end(pack({"trace": "00-" + "z" * 52})) is None
    assert otel.traceparent_at_end(b"") is None
    assert otel.traceparent_at_end(b"\xa5trace\xd9\x37" + b"\xff" * 55) is None


def test_the_broker_names_its_span_as_the_parent_in_the_body_it_forwards() -> None:
    from broker.protocol import pack, unpack

    tp = otel.format_traceparent(0xABC, 0xDEF, sampled=False)
    body = pack({"items": ["x" * 100], "trace": tp})
    forwarded = otel.with_parent(body, 0x1234)
    assert len(forwarded) == len(body)  # same size: the frame's bound holds
    payload = unpack(forwarded)
    assert payload["items"] == ["x" * 100]
    assert otel.parse_traceparent(payload["trace"]) == (0xABC, 0x1234, 0)  # trace, flags kept
    # Malformed or missing context, or no valid span id: the body goes on as it came.
    for bad in (pack({"trace": "00-" + "z" * 52}), pack({"items": [tp]}), b"", b"\xa5trace"):
        assert otel.with_parent(bad, 0x1234) is bad
    assert otel.with_parent(body, 0) is body
    assert otel.with_parent(body, 1 << 64) is body


def test_a_broker_with_traces_on_forwards_any_request_unharmed() -> None:
    """Trace context can never cost the broker a request: a tracer that raises
    leaves the body as it came, and no span."""
    from broker.protocol import pack
    from broker.server import Broker

    class Raising:
        def start_span(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("boom")

    broker = Broker.__new__(Broker)  # _trace uses only the tracer
    broker.tracer = Raising()
    body = pack({"trace": otel.format_traceparent(1, 2)})
    assert broker._trace("tool", body, 1) == (None, body)
    assert broker._trace("tool", b"\x00" * 70, 1) == (None, b"\x00" * 70)


def test_a_slow_web_viewer_is_closed_not_the_others(tmp_path: Path) -> None:
    import asyncio

    from supervisor.telemetry import web as web_mod

    loop = asyncio.new_event_loop()
    try:
        view = web_mod.WebView("127.0.0.1:0", manager=None, snapshot=None,  # type: ignore[arg-type]
                               home=tmp_path, loop=loop)
        slow, fast = view.subscribe(), view.subscribe()
        assert slow is not None
        assert fast is not None
        for i in range(web_mod.QUEUE_LIMIT + 5):
            view._broadcast("event", {"i": i})
            while not fast.empty():
                fast.get_nowait()
        assert slow.get_nowait() is None  # its backlog dropped, told to end
        assert view.subscribe() is not None  # room again; the fast one still listed
        with view._lock:
            assert fast in view._streams
            assert slow not in view._streams
    finally:
        loop.close()


def test_a_series_is_exposed_once_whatever_the_label_values() -> None:
    """Raw values past a label's bound become ``other``, and every worker's own
    ``tool@ID`` becomes ``tool_pinned``: the collector sums them into one
    sample per series (Prometheus rejects a scrape's duplicate series)."""
    import asyncio

    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from supervisor.telemetry.metrics import FarmCollector

    queues = {f"svc{i}": 1 for i in range(40)} | {f"tool@{i:016x}": 2 for i in range(30)}
    failures = {f"kind{i}": 1 for i in range(80)}
    status = {"broker": {"queues": queues, "counters": {"failures": failures},
                         "workers": {f"tool@{i:016x}": {"workers": [
                             {"capacity": 4, "in_flight": 1, "info": {"host": "h"}}]}
                             for i in range(30)}}}

    async def snapshot() -> dict[str, object]:
        return status

    loop = asyncio.new_event_loop()
    import threading
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        registry = CollectorRegistry()
        registry.register(FarmCollector(loop, snapshot, None))
        text = generate_latest(registry).decode()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
    seen: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in seen, f"two samples of one series: {key}"
            seen[key] = s.value
    assert seen[("corral_broker_queue_depth", (("service", "tool_pinned"),))] == 60
    assert sum(v for (n, _), v in seen.items() if n == "corral_broker_queue_depth") == 100
    assert sum(v for (n, _), v in seen.items() if n == "corral_broker_failures_total") == 80
    assert seen[("corral_workers", (("host", "h"), ("service", "tool_pinned")))] == 30


def test_a_taken_port_moves_only_when_allowed() -> None:
    """A restart's pinned metrics/web port taken by another process meanwhile: the
    supervisor serves on another free port (``--ports-may-move``, set by the farm on
    restarts) instead of failing into a restart loop; otherwise the error stands."""
    import errno
    import socket
    from http.server import HTTPServer, SimpleHTTPRequestHandler

    from supervisor.telemetry.setup import bind_or_move

    taker = socket.socket()
    taker.bind(("127.0.0.1", 0))
    taker.listen()
    taken = taker.getsockname()[1]
    servers: list[HTTPServer] = []

    def bind(port: int) -> int:
        server = HTTPServer(("127.0.0.1", port), SimpleHTTPRequestHandler)
        servers.append(server)
        return int(server.server_port)

    try:
        moved = bind_or_move(bind, taken, True, "metrics")
        assert moved not in (0, taken)
        with pytest.raises(OSError, match="in use") as refused:
            bind_or_move(bind, taken, False, "metrics")
        assert refused.value.errno == errno.EADDRINUSE
    finally:
        taker.close()
        for server in servers:
            server.server_close()
