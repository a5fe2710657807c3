"""Fixtures of the store tests: ``store`` runs each test on SQLite and on PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.store import SessionStore, Store
from tests.store.backends import open_backend


@pytest.fixture(scope="session")
def pg_database(pg_server: Any) -> Iterator[str]:
    """One database per xdist worker, emptied by each test that uses it."""
    url: str = pg_server.new_database()
    try:
        yield url
    finally:
        pg_server.drop_database(url)


BACKENDS = ["sqlite", "postgresql"]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The store implementation a test runs on (it opens the store itself)."""
    return str(request.param)


@pytest.fixture(params=BACKENDS)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SessionStore]:
    """A fresh store: a real SQLite file in tmp_path, or an emptied real PostgreSQL
    database; closed afterwards."""
    s = await open_backend(request, request.param, tmp_path)
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
async def sqlite_store(tmp_path: Path) -> AsyncIterator[Store]:
    """A fresh store on a real SQLite file (for tests that read the file itself)."""
    s = await Store.open(tmp_path / "corral.db")
    try:
        yield s
    finally:
        await s.close()
