from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from tests.engine import farm


@pytest.fixture(autouse=True)
def _remove_workspaces() -> Iterator[None]:
    yield
    while farm.CREATED_WORKSPACES:
        shutil.rmtree(farm.CREATED_WORKSPACES.pop(), ignore_errors=True)
