"""``corral chaos`` for 60 s with every fault kind: 0 violations.

The one 60-90 s run of CI (#14). A real farm (scripted provider, broker,
workers, supervisor) in its own process tree, sized small for a 2-core CI
machine: 3 sessions (one plain, one compacting its context, one whose
approvals the harness answers) on 2 workers. 60 s is past the schedule's
coverage bound for ``all`` at a 1.5 s gap (2 + 2 x 1.5 x 17 = 53 s), so every
timed fault kind must be injected (``faults_reached``), and the compaction
and approval windows must be hit. The planted bugs this same checker must
catch are in ``test_plants.py``.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import PYTHON, Procs

SEEDS = (11,)
FAULTS_METRIC = "corral_chaos_faults_injected_total"


def _scrape_while_running(proc: subprocess.Popen[bytes], procs: Procs,
                          deadline_s: float) -> dict[str, float]:
    """The last scrape of the faults metric taken while ``corral chaos`` ran,
    parsed with the official parser, from the URL it last said on its stderr
    (a supervisor the run restarts binds another port)."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + deadline_s
    last: dict[str, float] = {}
    tries: list[str] = []  # what each scrape got, for the failure message
    while proc.poll() is None and time.monotonic() < deadline:
        said = re.findall(r"metrics at (http://\S+/metrics)", procs.log(proc))
        url = said[-1] if said else None
        if url is not None:
            try:
                with urllib.request.urlopen(url, timeout=5) as resp:
                    text = resp.read().decode()
            except OSError as exc:  # the farm is stopping, or the supervisor restarting
                tries.append(f"{url}: {exc}")
            else:
                seen = {s.labels["kind"]: s.value
                        for family in text_string_to_metric_families(text)
                        for s in family.samples if s.name == FAULTS_METRIC}
                tries.append(f"{url}: {len(seen)} kinds")
                # The counts only grow (the harness's file); a scrape that caught the
                # supervisor restarting keeps what an earlier one saw.
                for kind, n in seen.items():
                    last[kind] = max(n, last.get(kind, 0.0))
        # A scrape interval, as Prometheus would; ends at once when the run does.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.5)
    if not last:
        print("scrapes of the chaos run's metrics:", *tries[-20:], sep="\n  ")
    return last


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("seed", SEEDS)
def test_chaos_60s_has_no_violation(seed: int, workspace_root: Path, procs: Procs) -> None:
    home = workspace_root / f"chaos-{seed}"
    proc = procs.spawn([PYTHON, "-m", "supervisor.cli", "chaos", "--seed", str(seed),
                        "--duration", "60", "--fault-gap", "1.5", "--sessions", "3",
                        "--workers", "2", "--metrics", "127.0.0.1:0",
                        "--json", "--home", str(home)],
                       name=f"chaos-{seed}", stdout=subprocess.PIPE)
    scraped = _scrape_while_running(proc, procs, deadline_s=400)
    out, _ = proc.communicate(timeout=60)
    lines = out.decode().strip().splitlines()
    assert lines, f"no report; log:\n{procs.log(proc)[-3000:]}"
    report = json.loads(lines[0])
    # The farm's /metrics counted the faults as they were injected, by kind:
    # the harness's timed faults and the broker's frame faults.
    by_kind = report["faults_by_kind"]
    assert scraped, "no scrape of corral_chaos_faults_injected_total"
    timed = {k: v for k, v in scraped.items() if k in by_kind}
    assert sum(timed.values()) >= len(by_kind) // 2, (scraped, by_kind)
    for kind, n in timed.items():
        assert n <= by_kind[kind]["injected"], (kind, n, by_kind[kind])
    assert {"drop", "delay", "duplicate"} <= set(scraped), scraped
    assert report["violations"] == [], (report["violations"][:3], lines[1:])
    assert proc.returncode == 0
    counts = report["counts"]
    assert report["seed"] == seed
    assert counts["sessions_final_turn_ok"] == counts["sessions"] == 3
    assert counts["turns"] > counts["sessions"]
    assert counts["tool_calls"] > 0
    assert counts["faults_injected"] > 0
    injected = [f for f in report["faults"] if "skipped" not in f]
    # Every injected process fault names its target; worker faults what it held.
    for f in injected:
        if f["kind"].endswith("_kill") or f["kind"].startswith("worker_"):
            assert f["pid"] > 0
            assert f["target"]
        if f["kind"] in ("worker_kill_model", "worker_kill_tool"):
            assert f["kind"].split("_")[-1] in f["in_flight"]
        if f["kind"] == "worker_kill_idle":
            assert f["in_flight"] == []
    assert report["checks"][0] == "turn_ends_once"
    # No process outlived the run: every pid the farm ever ran is checked (no_orphans).
    assert "no_orphans" in report["checks"]
    assert report["duration_s"] >= report["coverage_s"]
    assert "faults_reached" in report["checks"]
    for kind, k in report["faults_by_kind"].items():
        assert k["injected"] >= 1, (kind, k)
    by_kind = report["faults_by_kind"]
    assert by_kind["crash_compaction"]["hit"] >= 1, by_kind["crash_compaction"]
    assert by_kind["crash_approval_wait"]["hit"] >= 1, by_kind["crash_approval_wait"]
    assert counts["compactions"] > 0
    assert counts["approvals_requested"] > 0
    assert counts["approvals_answered"] > 0
    assert counts["sessions_by_role"] == {"ask": 1, "compact": 1, "plain": 1}
    assert {"approvals_kept", "compaction_once"} <= set(report["checks"])
