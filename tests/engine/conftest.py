from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from tests.engine import farm
from tests.helpers import Procs


@pytest.fixture(autouse=True)
def _remove_workspaces() -> Iterator[None]:
    yield
    while farm.CREATED_WORKSPACES:
        shutil.rmtree(farm.CREATED_WORKSPACES.pop(), ignore_errors=True)


@pytest.fixture(scope="module")
def farm_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[farm.FarmPool]:
    """Brokers and workers shared by a module's tests (farm.py's ``FarmPool``
    says which tests may use it); every process is killed by pid when the
    module ends. A module using it should be one xdist group, or each xdist
    worker that gets some of its tests starts (and, between other modules'
    tests, restarts) its own."""
    tmp = tmp_path_factory.mktemp("engine-pool")
    procs = Procs(tmp / "logs")
    try:
        yield farm.FarmPool(procs, tmp)
    finally:
        procs.kill_all()
