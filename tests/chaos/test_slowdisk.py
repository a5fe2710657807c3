"""The store's slow-disk hook: off by default, on only while its flag file exists."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.helpers import PYTHON, REPO

PROBE = """
import json, sqlite3, sys, time
from supervisor.store import slowdisk, writer
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
t = time.monotonic()
for _ in range(3):
    writer.apply_group(conn, writer.Sids(), [])
print(json.dumps({"stalls": slowdisk.stalls, "elapsed_s": time.monotonic() - t}))
"""


def probe(tmp_path: Path, env: dict[str, str]) -> dict[str, float]:
    out = subprocess.run([PYTHON, "-c", PROBE, str(tmp_path / "t.db")], cwd=REPO,
                         env={"PATH": "/usr/bin:/bin", **env}, capture_output=True,
                         text=True, timeout=60, check=True)
    result: dict[str, float] = json.loads(out.stdout)
    return result


def test_off_unless_the_environment_enables_it(tmp_path: Path) -> None:
    assert probe(tmp_path, {})["stalls"] == 0


def test_each_commit_stalls_while_the_flag_exists(tmp_path: Path) -> None:
    flag = tmp_path / "slow.flag"
    env = {"CORRAL_CHAOS_STORE_DELAY_S": "0.2", "CORRAL_CHAOS_STORE_DELAY_FLAG": str(flag)}
    assert probe(tmp_path, env)["stalls"] == 0
    flag.touch()
    on = probe(tmp_path, env)
    assert on["stalls"] == 3
    assert on["elapsed_s"] >= 0.6  # three commits, each held 0.2 s before COMMIT


def test_a_bad_value_is_refused(tmp_path: Path) -> None:
    out = subprocess.run([PYTHON, "-c", "import supervisor.store.slowdisk"], cwd=REPO,
                         env={"PATH": "/usr/bin:/bin", "CORRAL_CHAOS_STORE_DELAY_S": "soon"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "CORRAL_CHAOS_STORE_DELAY_S must be a number" in out.stderr
