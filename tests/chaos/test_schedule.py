"""The chaos schedule and workload are pure functions of the seed."""

from __future__ import annotations

import itertools

import pytest

from supervisor.chaos.schedule import (
    ALL_FAULTS,
    FRAME_FAULTS,
    PROVIDER_FAULTS,
    farm_shape,
    make_schedule,
    parse_faults,
)
from supervisor.chaos.workload import make_script


def test_the_same_seed_gives_the_same_schedule_and_script() -> None:
    kinds = parse_faults("all")
    assert make_schedule(7, 120, kinds) == make_schedule(7, 120, kinds)
    assert make_script(20, 3, 7, kinds) == make_script(20, 3, 7, kinds)


def test_different_seeds_give_different_schedules() -> None:
    kinds = parse_faults("all")
    schedules = {tuple(make_schedule(seed, 120, kinds)) for seed in range(5)}
    assert len(schedules) == 5
    scripts = [make_script(20, 3, seed, kinds) for seed in range(3)]
    assert scripts[0] != scripts[1] != scripts[2]


def test_only_named_timed_kinds_spaced_by_the_minimum_gap() -> None:
    kinds = parse_faults("worker_kill_tool,broker_kill,frame_drop,provider_500")
    schedule = make_schedule(3, 300, kinds, min_gap_s=2.5)
    assert schedule, "a 300 s run gets faults"
    assert {f.kind for f in schedule} <= {"worker_kill_tool", "broker_kill"}
    # Frame and provider faults are not timed: the broker and the script apply them.
    assert not {f.kind for f in schedule} & (set(FRAME_FAULTS) | set(PROVIDER_FAULTS))
    times = [f.at_s for f in schedule]
    assert times == sorted(times)
    assert all(b - a >= 2.5 for a, b in itertools.pairwise(times))
    assert times[-1] < 300


def test_provider_faults_go_into_the_script_once_per_entry() -> None:
    script = make_script(30, 3, 11, parse_faults("provider"))
    faulty = [r for r in script["responses"] if "times" in r]
    assert faulty, "some entries carry a provider fault"
    assert all(r["times"] == 1 for r in faulty)  # a retry gets the real answer


def test_fault_lists_are_checked() -> None:
    # "all" is the one-broker soak; the broker-set kinds are named (group brokers), the
    # supervisor-set kinds too (group supervisors)
    assert parse_faults("all") + parse_faults("brokers") + parse_faults("supervisors") \
        == ALL_FAULTS
    assert parse_faults("brokers") == ("broker_kill_one",)
    assert parse_faults("supervisors") == ("supervisor_stop", "pg_restart")
    # "all" follows the farm's shape: several supervisors run on PostgreSQL (no SQLite
    # store kinds, the supervisor-set kinds in), two brokers add broker_kill_one
    pg = parse_faults("all", supervisors=3, brokers=2)
    assert set(pg) == (set(ALL_FAULTS) - {"store_busy", "store_slow"})
    with pytest.raises(ValueError, match="store_busy: SQLite store faults"):
        parse_faults("store_busy,worker_kill_tool", supervisors=3)
    assert farm_shape("supervisor_stop", None, None) == (3, 1)
    assert farm_shape("all", 3, 2) == (3, 2)
    assert farm_shape("broker_kill_one", None, None) == (1, 2)
    with pytest.raises(ValueError, match="need --supervisors 2"):
        farm_shape("pg_restart", 1, None)
    assert "provider_kill" in parse_faults("process")
    with pytest.raises(ValueError, match="unknown fault 'nope'"):
        parse_faults("worker_kill_tool,nope")
