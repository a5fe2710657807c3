from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import Procs


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    """The shared ``procs`` fixture, plus closing the stdout pipes of readiness lines."""
    p = Procs(tmp_path / "logs")
    try:
        yield p
    finally:
        try:
            p.kill_all()
        finally:
            for proc in p.started:
                if proc.stdout is not None:
                    proc.stdout.close()
