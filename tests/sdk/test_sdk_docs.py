"""Every ``python`` block of docs/sdk.md runs, each as its own process (a real
embedded farm with the scripted provider), and exits 0; the blocks hold their
own asserts. Children left behind are killed by pid."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import PYTHON, REPO, Procs

DOC = REPO / "docs" / "sdk.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)


def test_the_guide_has_examples() -> None:
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_each_example_of_docs_sdk_md_runs(index: int, procs: Procs, tmp_path: Path) -> None:
    script = tmp_path / f"example_{index}.py"
    script.write_text(BLOCKS[index])
    proc = procs.spawn([PYTHON, str(script)], name=f"example{index}", stdout=subprocess.PIPE,
                       cwd=REPO)
    try:
        out, _ = proc.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        pytest.fail(f"example {index} did not finish within 100 s:\n{procs.log(proc)}")
    assert proc.returncode == 0, f"example {index} failed:\n{out.decode()}\n{procs.log(proc)}"
