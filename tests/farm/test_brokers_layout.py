"""``[farm] brokers``: the children and the command lines of a two-broker farm, the
bound on the option, and ``corral worker --broker`` repeated (no processes)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from supervisor.cli.remote import worker_argv
from supervisor.config import ConfigError, load
from supervisor.farm.layout import FarmPaths, child_specs


def _brokers_of(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--broker"]


def test_two_brokers_each_its_child_and_every_peer_gets_both(tmp_path: Path) -> None:
    (tmp_path / "corral.toml").write_text('[farm]\nbrokers = 2\nbackend_tcp = "127.0.0.1:7000"\n')
    cfg = load(tmp_path)
    paths = FarmPaths.of(tmp_path)
    specs = {s.name: s for s in child_specs(cfg, paths, workers=1)}
    assert [n for n in specs if n.startswith("broker")] == ["broker", "broker-2"]
    b1, b2 = specs["broker"].argv, specs["broker-2"].argv
    assert b1[b1.index("--frontend") + 1] == paths.broker_frontend
    assert b2[b2.index("--backend") + 1] == paths.broker_backend_of(2) != paths.broker_backend
    assert b2[b2.index("--backend-tcp") + 1] == "tcp://127.0.0.1:7001"  # port + N - 1
    assert _brokers_of(specs["worker-1"].argv) == [paths.broker_backend,
                                                   paths.broker_backend_of(2)]
    assert _brokers_of(specs["supervisor"].argv) == [paths.broker_frontend,
                                                     paths.broker_frontend_of(2)]
    # corral up --brokers wins over the file; one broker is the farm of before
    one = child_specs(cfg, paths, workers=1, brokers=1)
    assert [s.name for s in one if s.name.startswith("broker")] == ["broker"]


@pytest.mark.parametrize("value", ["0", "5", '"2"'])
def test_brokers_out_of_bounds_is_refused(tmp_path: Path, value: str) -> None:
    (tmp_path / "corral.toml").write_text(f"[farm]\nbrokers = {value}\n")
    with pytest.raises(ConfigError, match=r"farm"):
        load(tmp_path)


def test_corral_worker_passes_every_broker() -> None:
    ns = argparse.Namespace(broker=["tcp://a:5556", "tcp://b:5557"], services="tool",
                            capacity=4, drain_s=5.0, worker_log_level="INFO", server_key=None,
                            key=None, tier_min=None, heartbeat_interval_s=None, liveness=None)
    assert _brokers_of(worker_argv(ns)) == ["tcp://a:5556", "tcp://b:5557"]
