"""A collector that accepts the export and never answers: turns go on, the
supervisor's exporter queue stays bounded and its drops are counted in the
metrics, and every process still stops within its grace (no SIGKILL)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from supervisor.client import SupervisorClient
from tests.telemetry.test_metrics import run_turn, scrape, value

pytestmark = pytest.mark.timeout(180)

TURNS = 4
SCRIPT = {"responses": [{"text": f"answer {i}"} for i in range(TURNS)]}


@contextmanager
def hanging_collector() -> Iterator[tuple[str, list[int]]]:
    """An OTLP/HTTP endpoint that reads each export and then hangs until the end."""
    release = threading.Event()
    posts: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            posts.append(1)
            release.wait(120)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", posts
    finally:
        release.set()
        server.shutdown()
        server.server_close()
        thread.join(10)


async def test_a_hanging_collector_costs_no_turn_and_its_drops_are_counted(
        telemetry_farm: Callable[..., Any], workspace_root: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with hanging_collector() as (url, posts):
        # The farm's children inherit these: a queue of two spans, exported at once,
        # and an export that waits for the hanging collector longer than the test.
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", url)
        monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "2")
        monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "2")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "100")
        farm = await telemetry_farm(SCRIPT, workers=1,
                                    extra='[telemetry]\nmetrics_listen = "127.0.0.1:0"\n')
        ws = workspace_root / "ws"
        ws.mkdir()
        async with SupervisorClient(farm.endpoint) as sv:
            sid = await sv.create_session(workspace=str(ws))
            for i in range(TURNS):
                assert (await run_turn(sv, sid, f"turn {i}"))["type"] == "turn_complete"
        samples, _ = await scrape(farm.ready()["metrics"])
        assert posts, "the supervisor never reached the collector"
        assert value(samples, "corral_turns_ended_total", reason="completed") == TURNS
        # 2 spans a turn (turn, chat) against a queue of 2 behind a hung export.
        assert value(samples, "corral_trace_spans_dropped_total") >= 2
        # Each process's last export hangs: the stop must not wait for it past
        # the child's grace (5-10 s), else the tree SIGKILLs it.
        with caplog.at_level(logging.WARNING, logger="supervisor.farm.tree"):
            await farm.farm.tree.stop()
        killed = [r.getMessage() for r in caplog.records if "did not stop" in r.getMessage()]
        assert not killed, killed
