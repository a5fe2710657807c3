"""The soak report is rendered from a run's JSON, every figure read from it."""

from __future__ import annotations

from supervisor.chaos.reportmd import render


def test_every_kind_and_total_comes_from_the_report() -> None:
    report = {
        "seed": 42, "violations": [], "duration_s": 100.0, "elapsed_s": 130.0,
        "checks": ["turn_ends_once"],
        "counts": {"sessions": 8, "sessions_final_turn_ok": 8, "turns": 50, "tool_calls": 400,
                   "exports_verified": 12, "repeated_requests": 0,
                   "killed_calls": {"checked": 3}, "process_table_samples": 200},
        "faults_by_kind": {"worker_kill_tool": {"injected": 5, "skipped": 1, "hit": 4, "recovery": {
            "count": 4, "p50_s": 1.1, "p99_s": 2.5}}},
        "continuous_faults": {"frame": {"total": {"drop": 10, "delay": 11, "duplicate": 12}}},
        "provider_faults_in_script": {"provider_500": 7},
        "recovery": {"worker": {"count": 4, "p50_s": 1.1, "p99_s": 2.5, "max_s": 3.0,
                                "unrecovered": 0}},
        "phases_s": {"faults": 100.0}, "host": {"cpus": 2, "cpu_s": 150.0},
    }
    text = render(report, "corral chaos --seed 42")
    assert "**45** (5 timed, 33 frame, 7 provider)" in text
    assert "0.45 faults/s" in text
    assert "| worker_kill_tool | 5 | 4 | 1 | 4 | 1.1 s | 2.5 s |" in text
    assert "| frame_duplicate | 12 |" in text
    assert "| provider_500 | 7 |" in text
    assert "1.15 cores on average" in text
    assert "## Violations" not in text
