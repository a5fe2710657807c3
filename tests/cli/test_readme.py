"""README's "First session" and "Using it" commands, run as a new user would
(no provider key, so the scripted demo route; a fresh home). Only the paths
that would touch the real machine are redirected: the home (``~/.corral``,
through ``CORRAL_HOME`` or ``--home``) and the workspace (``/tmp/proj``,
``./proj``) go under a test directory."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.cli.test_first_hour import NO_KEYS
from tests.helpers import REPO

pytestmark = pytest.mark.timeout(240)


def block_after(heading: str) -> str:
    readme = (REPO / "README.md").read_text()
    start = readme.index(heading)
    found = re.search(r"```sh\n(.*?)```", readme[start:], flags=re.S)
    assert found is not None, f"no sh block after {heading!r}"
    return found.group(1)


def run_block(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-e", "-x", "-c", script], capture_output=True, text=True,
                          timeout=200, cwd=REPO, env=env, stdin=subprocess.DEVNULL)


def test_the_first_session_works_as_written(homes: list[Path], workspace_root: Path) -> None:
    block = block_after("### First session")
    assert "corral run --workspace /tmp/proj" in block
    home = workspace_root / "dot-corral"
    homes.append(home)
    proj = workspace_root / "proj"
    script = block.replace("/tmp/proj", str(proj))
    r = run_block(script, {**NO_KEYS, "CORRAL_HOME": str(home)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert "▶ list_dir" in r.stdout
    assert "notes.txt" in r.stdout
    assert "── turn complete" in r.stdout
    assert re.search(r"sess_\w+\s+idle\s+1\s", r.stdout), r.stdout
    assert "scripted demo model" in (home / "corral.toml").read_text()


def test_using_it_works_as_written(homes: list[Path], workspace_root: Path) -> None:
    block = block_after("## Using it")
    home = workspace_root / "home"
    homes.append(home)
    proj = workspace_root / "proj"
    proj.mkdir()
    proj.chmod(0o777)
    (proj / "a.txt").write_text("a\n")
    script = block.replace("~/.corral", str(home)).replace("./proj", str(proj))
    r = run_block(script, NO_KEYS)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "a.txt" in r.stdout
    assert "── turn complete" in r.stdout
    assert "farm stopped cleanly" in r.stdout
