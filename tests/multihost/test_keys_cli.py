"""``corral keys`` and ``corral worker`` argument handling, through the real CLI."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from broker.security import read_key_file
from tests.helpers import PYTHON, REPO


def corral(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", "supervisor.cli", *args], capture_output=True, text=True,
                          timeout=60, cwd=REPO)


def test_keys_new_init_allow(tmp_path: Path) -> None:
    home = tmp_path / "home"
    out = corral("keys", "new", "w1", "--dir", str(tmp_path / "k"), "--json")
    assert out.returncode == 0, out.stderr
    paths = json.loads(out.stdout)
    assert Path(paths["secret"]).stat().st_mode & 0o777 == 0o600
    again = corral("keys", "new", "w1", "--dir", str(tmp_path / "k"))
    assert again.returncode == 2
    assert "already exists" in again.stderr
    assert corral("keys", "init", "--home", str(home)).returncode == 0
    assert (home / "keys" / "broker.key_secret").stat().st_mode & 0o777 == 0o600
    assert read_key_file(home / "keys" / "allowed" / "supervisor.key").role == "supervisor"
    out = corral("keys", "allow", paths["public"], "--home", str(home), "--json")
    assert json.loads(out.stdout)["role"] == "worker"
    out = corral("keys", "allow", paths["secret"], "--home", str(home), "--tenant", "acme",
                 "--name", "w1-client")
    assert out.returncode == 0, out.stderr
    allowed = read_key_file(home / "keys" / "allowed" / "w1-client.key")
    assert (allowed.role, allowed.tenant, allowed.secret) == ("client", "acme", None)
    assert allowed.public == read_key_file(Path(paths["public"])).public
    bad = corral("keys", "allow", str(tmp_path / "nope.key"), "--home", str(home))
    assert bad.returncode == 2
    assert "cannot read key file" in bad.stderr


def test_worker_needs_keys_for_tcp() -> None:
    out = corral("worker", "--broker", "tcp://10.9.9.9:5556")
    assert out.returncode == 2
    assert "--server-key" in out.stderr
