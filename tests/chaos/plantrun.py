"""One short ``corral chaos --json`` run for the plant tests (test_plants,
test_plants_supervisors): 2 sessions on 2 workers at a 1 s fault gap, the child
started and killed by pid through ``Procs``, its report read back and checked to
agree with the exit status (1 with violations, else 0); and the verdict of a
plant run (``assert_plant_caught``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from tests.helpers import PYTHON, Procs


def run_chaos(home: Path, procs: Procs, name: str, faults: str, seed: int, duration: str,
              *extra: str) -> tuple[dict[str, Any], subprocess.Popen[bytes]]:
    """The run's JSON report and its process (for ``procs.log``); ``extra`` are more
    ``corral chaos`` arguments."""
    args = [PYTHON, "-m", "supervisor.cli", "chaos", "--seed", str(seed), "--duration",
            duration, "--fault-gap", "1", "--faults", faults, "--sessions", "2",
            "--workers", "2", "--json", "--home", str(home), *extra]
    proc = procs.spawn(args, name=name, stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=170)
    lines = out.decode().strip().splitlines()
    assert lines, f"no report; log:\n{procs.log(proc)[-3000:]}"
    report: dict[str, Any] = json.loads(lines[0])
    assert proc.returncode == (1 if report["violations"] else 0)
    return report, proc


def assert_plant_caught(report: dict[str, Any], plant: str, deciding: tuple[str, ...],
                        caught_by: set[str]) -> None:
    """A plant run's verdict: the plant was on, each deciding fault kind was injected
    AND hit its window (a run that caught nothing because its fault missed fails
    here saying so), and a violation names one of ``caught_by``."""
    assert report["plants"] == [plant]
    by_kind = report["faults_by_kind"]
    for kind in deciding:
        assert by_kind.get(kind, {}).get("hit", 0) >= 1, (kind, by_kind)
    found = {v["invariant"] for v in report["violations"]}
    assert found & caught_by, (plant, report["violations"], by_kind)
