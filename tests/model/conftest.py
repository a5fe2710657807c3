from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import Procs
from tests.model.stack import Stacks


def _stop(p: Procs) -> None:
    try:
        p.kill_all()
    finally:
        for proc in p.started:
            if proc.stdout is not None:
                proc.stdout.close()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    """The shared ``procs`` fixture, plus closing the stdout pipes of readiness lines."""
    p = Procs(tmp_path / "logs")
    try:
        yield p
    finally:
        _stop(p)


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stacks]:
    """Broker + worker stacks shared by a module's tests (stack.py says which
    tests may use them); every process is killed by pid when the module ends.
    A module using it should be one xdist group, or each xdist worker that
    gets some of its tests starts (and, between other modules' tests, restarts)
    its own."""
    tmp = tmp_path_factory.mktemp("model-stacks")
    p = Procs(tmp / "logs")
    try:
        yield Stacks(p, tmp)
    finally:
        _stop(p)
