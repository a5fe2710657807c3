from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import Procs


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    """Start real processes; every one is killed and reaped by pid afterwards."""
    p = Procs(tmp_path / "logs")
    try:
        yield p
    finally:
        p.kill_all()


@pytest.fixture
def workspace_root() -> Iterator[Path]:
    """A directory the sandbox uid can reach (pytest's tmp_path sits under a 0700
    directory of root, which a tool's non-root uid cannot traverse)."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="corral-test-", dir="/tmp"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)
