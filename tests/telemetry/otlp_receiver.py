"""A real OTLP/HTTP trace receiver for tests: a threaded HTTP server on port 0
that decodes each ``POST /v1/traces`` body (protobuf) with opentelemetry-proto
and keeps the spans, flattened, with their process's ``service.name``."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

MAX_BODY = 16 * 1024 * 1024


@dataclass
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    status_code: int
    attributes: dict[str, Any]
    events: list[str]
    start_ns: int = 0


@dataclass
class Receiver:
    url: str = ""
    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.spans)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    rec = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            if self.path != "/v1/traces" or not 0 <= length <= MAX_BODY:
                self.send_error(404)
                return
            req = ExportTraceServiceRequest()
            req.ParseFromString(self.rfile.read(length))
            got = []
            for rs in req.resource_spans:
                res = {a.key: _value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        got.append(ReceivedSpan(
                            str(res.get("service.name")), s.name, s.trace_id.hex(),
                            s.span_id.hex(), s.parent_span_id.hex(), s.kind, s.status.code,
                            {a.key: _value(a.value) for a in s.attributes},
                            [e.name for e in s.events], s.start_time_unix_nano))
            with rec.lock:
                rec.spans.extend(got)
                rec.requests += 1
            body = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    rec.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield rec
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
