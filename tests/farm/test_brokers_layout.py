"""``[farm] brokers``: the children and the command lines of a two-broker farm, the
bound on the option, ``corral worker --broker`` repeated, and the broker lists of a
host joining a farm (``[farm] broker_frontends`` / ``broker_backends``: validated,
used by ``corral worker`` and by a real ``python -m supervisor`` without --broker)."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest

from supervisor.cli.remote import worker_argv
from supervisor.config import ConfigError, load
from supervisor.farm.layout import FarmPaths, child_specs
from tests.helpers import Procs, read_ready


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


@pytest.mark.parametrize(("text", "needle"), [
    ('broker_frontends = "tcp://a:5555"', "must be a list"),
    ("broker_frontends = []", "at least one endpoint"),
    ('broker_backends = ["a:5556"]', "'a:5556' is not an endpoint"),
    ('broker_backends = [5556]', "5556 is not an endpoint"),
    ('broker_frontends = ["tcp://a:5555", "tcp://a:5555"]', "lists 'tcp://a:5555' twice"),
    ("broker_backends = [" + ", ".join(f'"tcp://h{i}:5556"' for i in range(9)) + "]",
     "at most 8"),
])
def test_broker_lists_are_validated(tmp_path: Path, text: str, needle: str) -> None:
    (tmp_path / "corral.toml").write_text(f"[farm]\n{text}\n")
    with pytest.raises(ConfigError, match=r"\[farm\.broker_(front|back)ends\]") as info:
        load(tmp_path)
    assert needle in str(info.value)


def test_corral_worker_takes_its_brokers_from_corral_toml(tmp_path: Path) -> None:
    from supervisor.cli import build_parser
    from supervisor.cli.remote import _worker_brokers

    (tmp_path / "corral.toml").write_text(
        '[farm]\nbroker_backends = ["tcp://b1:5556", "ipc:///run/b2.sock"]\n')
    ns = build_parser().parse_args(["worker", "--home", str(tmp_path)])
    assert _worker_brokers(ns) is None
    assert _brokers_of(worker_argv(ns)) == ["tcp://b1:5556", "ipc:///run/b2.sock"]
    given = build_parser().parse_args(["worker", "--home", str(tmp_path),
                                       "--broker", "tcp://c:5556"])
    assert _worker_brokers(given) is None
    assert _brokers_of(worker_argv(given)) == ["tcp://c:5556"]  # the command line wins
    (tmp_path / "corral.toml").write_text("")
    bare = build_parser().parse_args(["worker", "--home", str(tmp_path)])
    problem = _worker_brokers(bare)
    assert problem is not None
    assert "broker_backends" in problem


def test_a_supervisor_takes_its_brokers_from_corral_toml(tmp_path: Path) -> None:
    """A real ``python -m supervisor`` without --broker: the brokers of corral.toml
    (its ready line names them; a broker is connected to lazily), or exit 2 saying
    how to give them."""
    home = tmp_path / "home"
    home.mkdir()
    procs = Procs(tmp_path / "logs")
    try:
        bare = procs.python("supervisor", "--home", str(home), "--listen",
                            f"ipc://{tmp_path}/a.sock", name="bare")
        assert bare.wait(timeout=60) == 2
        assert "[farm] broker_frontends" in procs.log(bare)
        fronts = [f"ipc://{tmp_path}/f1.sock", f"ipc://{tmp_path}/f2.sock"]
        (home / "corral.toml").write_text(f"[farm]\nbroker_frontends = {fronts!r}\n"
                                          .replace("'", '"'))
        sv = procs.python("supervisor", "--home", str(home), "--listen",
                          f"ipc://{tmp_path}/b.sock", name="configured",
                          stdout=subprocess.PIPE)
        assert read_ready(sv, 60.0)["brokers"] == fronts
    finally:
        procs.kill_all()
