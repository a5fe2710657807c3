"""The demo: every kind of process killed mid-workload, and a fresh clone.

- the demo's workload with a worker (mid tool and mid model stream), the
  broker, the supervisor and the scripted provider each SIGKILLed once still
  reports 0 violations, and its exported checkpoint verifies;
- from a fresh ``git clone``, ``scripts/demo --help`` bootstraps ``.venv``
  and ``corral run`` against an ephemeral farm then completes a turn.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import PYTHON, REPO, Procs

EVERY_KIND = "worker_kill_tool,broker_kill,supervisor_kill,provider_kill,worker_kill_model"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_survives_every_kind_of_process_killed(workspace_root: Path,
                                                    procs: Procs) -> None:
    home = workspace_root / "demo"
    # Five sessions on two workers, a kill every 4 s: every kind still hits work in
    # flight, in half the CPU of the demo's defaults (docs/testing.md).
    proc = procs.spawn([PYTHON, "-m", "supervisor.devtools.demo", "--json", "--sessions", "5",
                        "--workers", "2", "--fault-gap", "4",
                        "--faults", EVERY_KIND, "--home", str(home)],
                       name="demo", stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=280)
    report = json.loads(out.decode().strip().splitlines()[-1])
    assert report["violations"] == []
    assert proc.returncode == 0
    fired = {f["kind"]: f for f in report["faults"]}
    assert set(fired) == set(EVERY_KIND.split(","))
    assert not [f for f in report["faults"] if "skipped" in f], report["faults"]
    assert {fired[k]["target"].split("-")[0] for k in fired} == {
        "worker", "broker", "supervisor", "fakellm"}
    assert "tool" in fired["worker_kill_tool"]["in_flight"]
    assert "model" in fired["worker_kill_model"]["in_flight"]
    counts = report["counts"]
    assert counts["sessions_final_turn_ok"] == counts["sessions"] == 5
    assert counts["tool_calls"] > 0
    assert report["export"]["ok"]
    assert Path(report["export"]["path"]).is_file()
    # Recovery was measured for the sessions the broker and supervisor kills hit.
    assert report["recovery"]["supervisor"]["count"] > 0
    assert report["recovery"]["broker"]["count"] > 0


def _git_checkout() -> bool:
    return shutil.which("git") is not None and (REPO / ".git").exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not _git_checkout(), reason="not a git checkout (or no git): "
                    "cannot test a fresh clone")
def test_fresh_clone_demo_help_then_corral_run(workspace_root: Path) -> None:
    clone = workspace_root / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=120)
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("VIRTUAL_ENV", None)
    helped = subprocess.run([str(clone / "scripts" / "demo"), "--help"], cwd=clone, env=env,
                            capture_output=True, text=True, timeout=540)
    assert helped.returncode == 0, helped.stderr[-2000:]
    for option in ("--sessions", "--no-chaos", "--model", "--faults"):
        assert option in helped.stdout
    corral = clone / ".venv" / "bin" / "corral"
    assert corral.exists(), "scripts/demo bootstrapped .venv with the corral command"
    # the demo needs the runtime only: the test extra (pytest, mypy, ruff...) is
    # scripts/test's, and left out it halves a new user's first install
    assert not (clone / ".venv" / "bin" / "pytest").exists()
    script = workspace_root / "script.json"
    script.write_text(json.dumps({"responses": [
        {"tool_calls": [{"name": "shell",
                         "arguments": {"command": "echo from-a-fresh-clone > hello.txt"}}]},
        {"text": "wrote hello.txt", "usage": {"input": 10, "output": 3}},
    ]}))
    ws = workspace_root / "ws"
    ws.mkdir()
    ws.chmod(0o777)
    run = subprocess.run([str(corral), "run", "--home", str(workspace_root / "home"),
                          "--model", f"script:{script}", "--workspace", str(ws),
                          "--approval", "allow", "--workers", "1", "--timeout-s", "120",
                          "write hello.txt"],
                         cwd=clone, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-2000:])
    assert (ws / "hello.txt").read_text().strip() == "from-a-fresh-clone"
    assert "wrote hello.txt" in run.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("args", "says"), [
    (["--fault-gap", "1"], "--fault-gap 1 is too short"),
    (["--faults", "worker_kill_tool,nope"], "unknown fault(s) ['nope']"),
])
def test_bad_demo_options_are_refused_before_anything_starts(
        workspace_root: Path, args: list[str], says: str) -> None:
    home = workspace_root / "never"
    r = subprocess.run([PYTHON, "-m", "supervisor.devtools.demo", "--home", str(home), *args],
                       capture_output=True, text=True, timeout=50)
    assert r.returncode == 2
    assert says in r.stderr
    assert not home.exists()
