"""Planted bugs in what the farm records rather than what it runs: usage, the
stored transcript and the exported transcript. Each is caught by ``corral chaos``
from the evidence alone (the store after the farm stopped, the script the
harness wrote, the kept export files), as in ``test_plants.py``: a short run
with the fault kinds that take the bad path, a violation naming the invariant,
the deciding fault hit; and the same kinds without a plant report nothing.

- ``usage_double_retry``: a model step that needed a retry (a supervisor crash
  mid stream, a provider 500) counts its answer's usage twice; caught by
  ``usage_accounted`` (the step's ``token_count`` against the script's usage).
- ``compaction_drops_user``: a compaction keeps the recent user messages but
  the newest; caught by ``transcript_complete`` (the ``compact`` session, index
  1, compacts before most model steps).
- ``export_drops_message``: an export's transcript lacks the newest assistant
  message; its calls and outputs are intact, so it verifies (the digest covers
  what it holds); caught by ``export_matches_store``.
- ``replay_overlap``: a subscription replays two events before the sequence the
  client asked for; the SDK client drops them (so the live log the checker
  kept was whole and the bug went unseen) but now counts them
  (``SupervisorClient.resent_events``); caught by ``replay_equals_live``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.plantrun import assert_plant_caught, run_chaos
from tests.helpers import Procs

SEEDS = {"usage_double_retry": 18, "compaction_drops_user": 19, "export_drops_message": 20,
         "replay_overlap": 22}
CLEAN_SEED = 21
DURATION_S = "6"
# plant -> (fault kinds, kinds that must have hit, the invariant that names it)
PLANTS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "usage_double_retry": ("crash_model_stream,provider_500", ("crash_model_stream",),
                           "usage_accounted"),
    "compaction_drops_user": ("crash_compaction", ("crash_compaction",), "transcript_complete"),
    "export_drops_message": ("crash_final_answer", (), "export_matches_store"),
    # a crash makes every client resubscribe from the last sequence it saw
    "replay_overlap": ("crash_final_answer", ("crash_final_answer",), "replay_equals_live"),
}
# the clean run: every timed kind above (3 kinds at a 1 s gap: coverage 6 s)
ALL_KINDS = "crash_model_stream,crash_compaction,crash_final_answer,provider_500"


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_each_accounting_plant_is_caught(plant: str, workspace_root: Path,
                                         procs: Procs) -> None:
    faults, deciding, caught_by = PLANTS[plant]
    report, _ = run_chaos(workspace_root / f"plant-{plant}", procs, f"chaos-{plant}", faults,
                          SEEDS[plant], DURATION_S, "--plant", plant)
    assert_plant_caught(report, plant, deciding, {caught_by})
    if plant == "export_drops_message":
        assert report["counts"]["exports_verified"] >= 1


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_accounting_run_without_a_plant_is_clean(workspace_root: Path,
                                                     procs: Procs) -> None:
    report, _ = run_chaos(workspace_root / "plant-none", procs, "chaos-none", ALL_KINDS,
                          CLEAN_SEED, DURATION_S)
    assert report["violations"] == [], report["violations"]
    assert {"usage_accounted", "transcript_complete",
            "export_matches_store"} <= set(report["checks"])
    assert report["duration_s"] >= report["coverage_s"]
    assert all(report["faults_by_kind"][k]["hit"] >= 1
               for k in ("crash_model_stream", "crash_compaction")), report["faults_by_kind"]
