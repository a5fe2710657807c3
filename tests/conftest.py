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
