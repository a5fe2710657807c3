"""Plants are off unless asked for, refused by a normal farm; crash points can be
armed at run time, once."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
from pathlib import Path

import pytest

from broker import plants
from supervisor.chaos.schedule import (
    ALL_FAULTS,
    WINDOW_POINTS,
    coverage_s,
    make_schedule,
    parse_faults,
    timed_kinds,
)
from supervisor.crashpoints import POINTS
from tests.helpers import PYTHON, REPO

ENV = {"PATH": "/usr/bin:/bin"}


def run(code: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-c", code], cwd=REPO, env={**ENV, **env},
                          capture_output=True, text=True, timeout=timeout)


def test_no_plant_is_on_without_the_variable_and_names_are_checked() -> None:
    assert frozenset() == plants.ACTIVE  # the test process never has one on
    assert not any(plants.on(name) for name in plants.PLANTS)
    with pytest.raises(KeyError):
        plants.on("no_such_plant")
    assert plants.parse("double_turn_end, no_tree_kill") == {"double_turn_end", "no_tree_kill"}
    with pytest.raises(ValueError, match="unknown plant"):
        plants.parse("double_turn_end,typo")
    out = run("from broker import plants; print(sorted(plants.ACTIVE))",
              {plants.ENV: "no_tree_kill"})
    assert out.stdout.strip() == "['no_tree_kill']"
    bad = run("import broker.plants", {plants.ENV: "typo"})
    assert bad.returncode != 0
    assert "unknown plant(s) typo" in bad.stderr


def test_a_normal_farm_refuses_to_start_with_a_plant_in_its_environment(
        tmp_path: Path) -> None:
    out = subprocess.run([PYTHON, "-m", "supervisor.cli", "up", "--home", str(tmp_path)],
                         cwd=REPO, env={**ENV, plants.ENV: "double_turn_end"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "CORRAL_CHAOS_PLANTS is set" in out.stderr
    assert not (tmp_path / "run" / "farm.json").exists()


ARMED = """
import sys
from supervisor import crashpoints
assert crashpoints.ARMED
crashpoints.reach("model_reply")  # not the armed point: nothing happens
print("alive", flush=True)
crashpoints.reach(sys.argv[1])
print("survived", flush=True)
"""


def test_a_crash_point_armed_through_its_file_fires_once(tmp_path: Path) -> None:
    arm = tmp_path / "arm"
    arm.write_text("final_answer")
    env = {"CORRAL_CRASHPOINT_ARM": str(arm)}
    out = subprocess.run([PYTHON, "-c", ARMED, "final_answer"], cwd=REPO, env={**ENV, **env},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == -signal.SIGKILL
    assert out.stdout.split() == ["alive"]
    assert not arm.exists()
    fired = (tmp_path / "arm.fired").read_text().split()
    assert fired[0] == "final_answer"
    assert float(fired[1]) > 0
    assert int(fired[2]) > 0
    # claimed: a second process reaching the point survives
    again = subprocess.run([PYTHON, "-c", ARMED, "final_answer"], cwd=REPO,
                           env={**ENV, **env}, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0
    assert again.stdout.split() == ["alive", "survived"]


def test_crash_points_are_no_ops_unless_armed() -> None:
    out = run("from supervisor import crashpoints as c; c.reach('final_answer');"
              "print(c.ARMED)", {})
    assert out.stdout.strip() == "False"
    assert set(WINDOW_POINTS.values()) <= POINTS
    assert os.environ.get("CORRAL_CRASHPOINT_ARM") is None


def test_every_enabled_timed_kind_is_scheduled_within_the_coverage_bound() -> None:
    kinds = parse_faults("all")
    # "all" is the one-broker soak; the broker-set and supervisor-set kinds are named
    # on their own (or come with --brokers 2 / --supervisors 3)
    assert set(ALL_FAULTS) == set(kinds) | set(parse_faults("brokers")) | set(
        parse_faults("supervisors"))
    timed = set(timed_kinds(kinds))
    assert {"crash_publish", "crash_final_answer", "interrupt_tool"} <= timed
    for seed in range(20):
        for gap in (1.0, 2.5):
            bound = coverage_s(kinds, gap)
            schedule = make_schedule(seed, bound + 0.01, kinds, min_gap_s=gap)
            assert {f.kind for f in schedule} == timed, (seed, gap)
            # the first round holds each kind once
            assert sorted(f.kind for f in schedule[:len(timed)]) == sorted(timed)
            times = [f.at_s for f in schedule]
            assert all(gap <= b - a <= 2 * gap + 1e-6 for a, b in itertools.pairwise(times))
    # the old schedule: seed 7, 40 s, 'all' had no supervisor or broker kill at all
    forty = {f.kind for f in make_schedule(7, 40, parse_faults("process"))}
    assert {"broker_kill", "supervisor_kill"} <= forty


def test_bad_rates_and_plant_names_are_refused_before_any_farm_starts(tmp_path: Path) -> None:
    for args, needle in [(["--frame-rate", "0.9"],
                          "--frame-rate: must be at least 0 and at most 0.5, got 0.9"),
                         (["--provider-rate", "-1"],
                          "--provider-rate: must be at least 0 and at most 1, got -1"),
                         (["--fault-gap", "0"], "--fault-gap: must be above 0, got 0"),
                         (["--plant", "nope"], "invalid choice: 'nope'")]:
        out = subprocess.run([PYTHON, "-m", "supervisor.cli", "chaos", "--home",
                              str(tmp_path / "h"), *args], cwd=REPO, env=ENV,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert needle in out.stdout + out.stderr
    assert not (tmp_path / "h" / "run").exists()


def test_a_workspace_left_by_an_earlier_run_is_refused(tmp_path: Path) -> None:
    # Effects are counted on disk: markers left by an earlier run would read as
    # effects run twice (seen when a run was repeated with the same --home).
    left = tmp_path / "h-ws" / "s0"
    left.mkdir(parents=True)
    (left / "effects.log").write_text("m-0\n")
    out = subprocess.run([PYTHON, "-m", "supervisor.cli", "chaos", "--home", str(tmp_path / "h"),
                          "--sessions", "1", "--duration", "1"], cwd=REPO, env=ENV,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "is not empty: a previous run's effects would be counted" in out.stderr
