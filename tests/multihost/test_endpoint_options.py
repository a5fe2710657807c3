"""Endpoint options of every process, as a user types them: a malformed one, a port
outside 1..65535, a bind-only form given to connect. Each is a usage error (exit 2)
naming the option, before anything starts; they once were Python tracebacks from
inside the running process (``ZMQError: Invalid argument``), and ``--listen
tcp://127.0.0.1:99999`` served on some other, random port."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from supervisor import config as config_mod

pytestmark = pytest.mark.timeout(120)


def _run(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize(("argv", "option"), [
    (["-m", "supervisor", "--listen", "nonsense", "--broker", "ipc:///nowhere"], "--listen"),
    (["-m", "supervisor", "--listen", "tcp://127.0.0.1:99999", "--broker", "ipc:///nowhere"],
     "--listen"),
    (["-m", "supervisor", "--listen", "ipc:///tmp/x.sock", "--broker", "nonsense"], "--broker"),
    (["-m", "supervisor", "--listen", "ipc:///tmp/x.sock", "--broker", "tcp://*:5555"],
     "--broker"),
    (["-m", "broker", "--frontend", "nonsense", "--backend", "ipc:///tmp/b"], "--frontend"),
    (["-m", "broker", "--frontend", "ipc:///tmp/f", "--backend", "tcp://0.0.0.0:65536"],
     "--backend"),
    (["-m", "sandbox_worker", "--broker", "tcp://broker:0"], "--broker"),
    (["-m", "supervisor.cli", "worker", "--broker", "broker:5556"], "--broker"),
])
def test_a_bad_endpoint_is_a_usage_error(tmp_path: Path, argv: list[str], option: str) -> None:
    if argv[1] == "supervisor":
        argv = [*argv, "--home", str(tmp_path / "home")]
    out = _run(tmp_path, *argv)
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr[-3000:])
    assert f"argument {option}" in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "ready" not in out.stdout, out.stdout


@pytest.mark.parametrize(("key", "value"), [
    ("broker_frontends", '["tcp://broker1:99999"]'),
    ("broker_backends", '["tcp://broker1:0"]'),
    ("backend_tcp", '"0.0.0.0:70000"'),
])
def test_a_bad_endpoint_in_corral_toml_is_a_config_error(tmp_path: Path, key: str,
                                                         value: str) -> None:
    (tmp_path / "corral.toml").write_text(f"[farm]\n{key} = {value}\n")
    with pytest.raises(config_mod.ConfigError, match=rf"\[farm.{key}\]"):
        config_mod.load(tmp_path)
