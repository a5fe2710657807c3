"""Fixtures of the store tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from supervisor.store import Store


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    """A fresh store on a real SQLite file in the test's tmp_path, closed afterwards."""
    s = await Store.open(tmp_path / "corral.db")
    try:
        yield s
    finally:
        await s.close()
