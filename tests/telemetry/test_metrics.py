"""Prometheus metrics scraped from a real farm during a run with a worker
SIGKILLed mid tool call, parsed with prometheus_client's own text parser."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from supervisor.client import SupervisorClient
from tests.helpers import eventually

pytestmark = pytest.mark.timeout(180)

SCRIPT = {"responses": [
    {"text": "hello", "usage": {"input": 11, "output": 4}},
    {"tool_calls": [{"name": "shell", "arguments": {"command": "echo hi"}}],
     "usage": {"input": 20, "output": 5}},
    {"text": "ran it", "usage": {"input": 30, "output": 6}},
    {"tool_calls": [{"name": "shell", "arguments": {"command": "sleep 30; echo late"}}]},
    {"text": "the worker was lost", "usage": {"input": 40, "output": 7}},
]}

DASHBOARD = (Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json").read_text()
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(url: str) -> tuple[Samples, set[str]]:
    async with httpx.AsyncClient(timeout=10) as client:
        resp = await client.get(url)
    resp.raise_for_status()
    assert resp.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    families: set[str] = set()
    for family in text_string_to_metric_families(resp.text):
        families.add(family.name)
        assert family.documentation, f"{family.name} has no HELP"
        assert family.type != "unknown", f"{family.name} has no TYPE"
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in samples, f"two samples of one series: {key}"
            samples[key] = s.value
    return samples, families


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum over the samples of ``name`` whose labels include ``labels``."""
    return sum(v for (n, ls), v in samples.items()
               if n == name and set(labels.items()) <= set(ls))


async def run_turn(sv: SupervisorClient, sid: str, text: str) -> dict[str, Any]:
    sub = await sv.submit(sid, {"type": "user_input", "text": text})
    async with asyncio.timeout(60):
        async for e in sv.events(sid):
            if e.get("submission_id") == sub and e["type"] in ("turn_complete",
                                                                 "turn_aborted"):
                return e
    raise AssertionError("event stream ended")


async def test_metrics_of_a_run_with_a_worker_killed(telemetry_farm: Callable[..., Any],
                                                     workspace_root: Path) -> None:
    farm = await telemetry_farm(SCRIPT, extra='[telemetry]\nmetrics_listen = "127.0.0.1:0"\n')
    url = farm.ready()["metrics"]
    assert url.startswith("http://127.0.0.1:")
    assert url.endswith("/metrics")
    before, families = await scrape(url)
    for name in ("corral_sessions", "corral_workers", "corral_worker_slots",
                 "corral_broker_queue_depth", "corral_approvals_pending",
                 "corral_process_restarts", "corral_broker_up"):
        assert name in families, name
    assert value(before, "corral_broker_up") == 1
    ws = workspace_root / "ws"
    ws.mkdir()
    async with SupervisorClient(farm.endpoint) as sv:
        sid = await sv.create_session(workspace=str(ws))
        assert (await run_turn(sv, sid, "say hello"))["type"] == "turn_complete"
        assert (await run_turn(sv, sid, "run echo"))["type"] == "turn_complete"

        # A turn whose tool call loses its worker to SIGKILL.
        sub = await sv.submit(sid, {"type": "user_input", "text": "sleep"})
        victim = await eventually(lambda: _tool_worker_pid(sv), timeout_s=30,
                                  what="a worker to hold the tool call")
        mid, _ = await scrape(url)  # scraped mid-call: a busy tool slot
        assert value(mid, "corral_worker_slots", service="tool", state="busy") >= 1
        os.kill(victim, signal.SIGKILL)
        async with asyncio.timeout(60):
            async for e in sv.events(sid):
                if e.get("submission_id") == sub and e["type"] in ("turn_complete",
                                                                     "turn_aborted"):
                    break

        async def restarted() -> Samples | None:
            s, _ = await scrape(url)
            return s if value(s, "corral_process_restarts_total", role="worker") >= 1 else None

        after = await eventually(restarted, timeout_s=30, what="the worker's restart counted")
    assert value(after, "corral_turns_started_total") == 3
    assert value(after, "corral_turns_ended_total", reason="completed") == 3
    assert value(after, "corral_turn_duration_seconds_count") == 3
    assert value(after, "corral_model_calls_total", route="s", outcome="ok") == 5
    assert value(after, "corral_model_tokens_total", route="s", type="input") >= 101
    assert value(after, "corral_model_tokens_total", route="s", type="output") >= 22
    assert value(after, "corral_model_time_to_first_token_seconds_count", route="s") == 5
    assert value(after, "corral_model_call_duration_seconds_count", route="s") == 5
    assert value(after, "corral_tool_calls_total", tool="shell", outcome="ok") == 1
    assert value(after, "corral_tool_calls_total", tool="shell") == 2
    tiers = {dict(ls).get("tier") for (n, ls) in after if n == "corral_tool_calls_total"}
    assert tiers & {"T2", "T2-", "T1"}, tiers
    assert value(after, "corral_tool_duration_seconds_count", tool="shell") >= 1
    assert value(after, "corral_request_failures_total", service="tool",
                 kind="worker_lost") == 1
    assert value(after, "corral_worker_lost_total") >= 1
    assert value(after, "corral_store_commit_seconds_count") > 10
    assert value(after, "corral_sessions", state="idle") == 1
    assert value(after, "corral_approvals_pending") == 0
    assert value(after, "corral_workers", service="tool") >= 1
    # Every series the sample Grafana dashboard queries exists.
    _, families = await scrape(url)
    series = {n for (n, _ls) in after}
    for name in set(re.findall(r"corral_[a-z_]+", DASHBOARD)):
        assert name in series or name.removesuffix("_total") in families, name
    # Bounded labels: no session id anywhere in a label, and no worker's id:
    # each worker serves its own ``tool@ID`` (new at each start, so a worker
    # killed and restarted would add a series) and it is counted as a class.
    services = {v for (_n, ls) in after for k, v in ls if k == "service"}
    assert services <= {"model", "tool", "tool_pinned", "tool_image"}, services
    assert value(after, "corral_workers", service="tool_pinned") >= 1
    for (_name, labels) in after:
        for _k, v in labels:
            assert sid not in v


async def _tool_worker_pid(sv: SupervisorClient) -> int | None:
    status = await sv.status()
    for w in status["broker"]["workers"].get("tool", {}).get("workers", []):
        if "tool" in (w.get("in_flight_services") or []):
            return int(w["info"]["pid"])
    return None


async def test_a_restarted_supervisor_serves_metrics_and_web_on_the_same_ports(
        telemetry_farm: Callable[..., Any]) -> None:
    """Port 0 picks a free port once: a supervisor SIGKILLed and restarted by the
    root binds the same one again, so the scrape job and the browser still
    reach it."""
    farm = await telemetry_farm(SCRIPT, workers=1, extra=(
        '[telemetry]\nmetrics_listen = "127.0.0.1:0"\n[web]\nlisten = "127.0.0.1:0"\n'))
    first = farm.ready()
    assert first["metrics"].endswith("/metrics")
    old = farm.pid("supervisor")
    os.kill(old, signal.SIGKILL)

    async def restarted() -> dict[str, Any] | None:
        child = farm.farm.tree.children["supervisor"]
        if child.state == "running" and child.pid not in (None, old) and child.ready:
            return dict(child.ready)
        return None

    again = await eventually(restarted, timeout_s=60, what="the supervisor's restart")
    assert again["metrics"] == first["metrics"]
    assert again["web"] == first["web"]
    samples, _ = await scrape(first["metrics"])
    assert value(samples, "corral_process_restarts_total", role="supervisor") == 1
