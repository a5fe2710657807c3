"""The supervisor-set faults under ``corral chaos``: a farm of several supervisors and two
brokers on a real PostgreSQL, its fencing invariant shown able to fail.

``epoch_reused`` (``broker/plants.py``) makes a session's lease keep its epoch when
another supervisor takes it: the fencing token does not change with the owner. With
``supervisor_stop`` (a supervisor SIGSTOPped past its lease, its sessions taken over,
then SIGCONT) the run must report ``fencing``, read from the events' recorded leases on
the disk, with the stop injected and hit. The same shape without the plant, under
``supervisor_stop``, ``supervisor_kill`` (one of the two) and ``broker_kill_one``, must
report no violation, every kind hit, and turns that crossed owners. A crash point
claimed by one of two supervisors must count only that one's sessions in its recovery.

Both runs use a fresh database of the tests' PostgreSQL (``pg_server``; ``pg_restart``
needs the run's own cluster and is left to the offline runs, docs/chaos.md). Each is
short: 2 supervisors, 2 sessions on 2 workers, a 6-8 s fault phase at a 1 s gap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.chaos.plantrun import run_chaos
from tests.helpers import Procs

PLANT_SEED = 15
CLEAN_SEED = 16
CLEAN_KINDS = "supervisor_stop,supervisor_kill,broker_kill_one"
CRASH_SEED = 17
CRASH_KINDS = "crash_tool_running,crash_model_stream"


def chaos(home: Path, procs: Procs, url: str, faults: str, seed: int, duration: str,
          *extra: str) -> dict[str, Any]:
    report, proc = run_chaos(home, procs, f"chaos-{seed}", faults, seed, duration,
                             "--supervisors", "2", "--store-url", url, *extra)
    assert report["farm"]["store"] == "postgresql"
    # every supervisor stopped by itself at the end (its lease task was once never
    # cancelled: each was SIGKILLed by the farm after its 10 s shutdown timeout)
    assert "did not stop within" not in procs.log(proc)
    return report


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_fencing_token_that_keeps_its_epoch_is_caught(workspace_root: Path, procs: Procs,
                                                        pg_server: Any) -> None:
    url = pg_server.new_database()
    try:
        report = chaos(workspace_root / "plant-epoch", procs, url, "supervisor_stop",
                       PLANT_SEED, "6", "--plant", "epoch_reused")
    finally:
        pg_server.drop_database(url)
    assert report["plants"] == ["epoch_reused"]
    assert report["faults_by_kind"]["supervisor_stop"]["hit"] >= 1, report["faults_by_kind"]
    found = {v["invariant"] for v in report["violations"]}
    assert "fencing" in found, report["violations"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_supervisor_set_faults_without_a_plant_are_clean(workspace_root: Path, procs: Procs,
                                                        pg_server: Any) -> None:
    url = pg_server.new_database()
    try:
        report = chaos(workspace_root / "plant-none-sup", procs, url, CLEAN_KINDS,
                       CLEAN_SEED, "8", "--brokers", "2")
    finally:
        pg_server.drop_database(url)
    assert report["violations"] == [], report["violations"]
    assert "fencing" in report["checks"]
    assert report["duration_s"] >= report["coverage_s"]
    by_kind = report["faults_by_kind"]
    assert all(by_kind[k]["hit"] >= 1 for k in CLEAN_KINDS.split(",")), by_kind
    # turns crossed owners: a session's events on disk came from several supervisors
    assert report["owners"]["sessions_with_several_owners"] >= 1, report["owners"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_crash_point_counts_only_the_claimers_sessions(workspace_root: Path, procs: Procs,
                                                         pg_server: Any) -> None:
    """On 2 supervisors any one may claim an armed crash point and kill itself; its
    recovery counts the sessions it owned (the lease rows naming it, read right after
    the claim), not every session with a turn running on the other one too."""
    url = pg_server.new_database()
    try:
        report = chaos(workspace_root / "crash-own", procs, url, CRASH_KINDS, CRASH_SEED,
                       "8", "--sessions", "4")
    finally:
        pg_server.drop_database(url)
    assert report["violations"] == [], report["violations"]
    hits = [f for f in report["faults"]
            if f["kind"] in CRASH_KINDS.split(",") and f.get("hit") and "skipped" not in f]
    assert hits, report["faults"]
    for f in hits:
        assert f.get("owner"), f  # the claimer's lease rows were read
        assert set(f["affected"]) <= set(f["sessions"]), f
    # the claimer's own session had a turn running (it was mid call or mid stream)
    assert any(f["affected"] for f in hits), hits
