"""Every planted bug is caught by ``corral chaos``, from the evidence alone.

Each plant (``broker/plants.py``) is switched on in the farm of a short run,
with the same seed, duration and fault kinds for all; the run must report at
least one violation naming the invariant that plant breaks. The same run
without a plant must report none. The harness and the invariants do not know
which plant is on: only the farm's processes do.

The fault kinds are the ones these plants need to show (a supervisor crash
between a commit and its publish, in a turn's stopping phase and mid tool; a
worker killed mid call; an interrupt mid call); every run is at least
``coverage_s`` long for them, so each kind is injected. The seven runs are
separate tests, spread over the xdist workers.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers import PYTHON, Procs

SEED = 8
FAULTS = ("crash_publish,crash_final_answer,crash_tool_running,worker_kill_tool,worker_hang,"
          "worker_kill_model,interrupt_tool")
CAUGHT_BY = {
    "rerun_after_restart": {"effect_at_most_once"},
    "publish_before_commit": {"replay_equals_live"},
    "lost_call_as_timeout": {"unknown_reported", "recovery_accounted"},
    "no_tree_kill": {"no_orphans"},
    "double_turn_end": {"turn_ends_once"},
    "export_digest_partial": {"exports_verify"},
}


def chaos(home: Path, procs: Procs, plant: str | None) -> dict[str, object]:
    args = [PYTHON, "-m", "supervisor.cli", "chaos", "--seed", str(SEED), "--duration", "30",
            "--fault-gap", "1.5", "--faults", FAULTS, "--sessions", "3", "--workers", "2",
            "--json", "--home", str(home)]
    if plant is not None:
        args += ["--plant", plant]
    proc = procs.spawn(args, name=f"chaos-{plant}", stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=280)
    lines = out.decode().strip().splitlines()
    assert lines, f"no report; log:\n{procs.log(proc)[-3000:]}"
    report: dict[str, object] = json.loads(lines[0])
    assert proc.returncode == (1 if report["violations"] else 0)
    return report


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("plant", sorted(CAUGHT_BY))
def test_each_plant_is_caught_naming_its_invariant(plant: str, workspace_root: Path,
                                                   procs: Procs) -> None:
    report = chaos(workspace_root / f"plant-{plant}", procs, plant)
    assert report["plants"] == [plant]
    found = {v["invariant"] for v in report["violations"]}  # type: ignore[attr-defined]
    assert found & CAUGHT_BY[plant], (plant, report["violations"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_same_run_without_a_plant_is_clean(workspace_root: Path, procs: Procs) -> None:
    report = chaos(workspace_root / "plant-none", procs, None)
    assert report["violations"] == [], report["violations"]
    by_kind = report["faults_by_kind"]
    assert all(by_kind[k]["injected"] >= 1 for k in FAULTS.split(",")), by_kind  # type: ignore[index]
