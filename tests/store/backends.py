"""Opening either store implementation in tests, and counting its rows."""

from __future__ import annotations

import os
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import psycopg
import pytest

from supervisor.store import SessionStore, Store
from supervisor.store.pg.store import PgStore
from tests.helpers import eventually

TABLES = ("executions", "events", "context_rewrites", "transcript_batches",
          "checkpoint_state", "sessions", "leases", "supervisors")


async def supervisor_waits_on_lock(db: psycopg.AsyncConnection[Any], what: str) -> None:
    """Until exactly one of the store's connections (application_name
    ``corral-supervisor``) waits on a lock, as ``db`` (another connection) sees it."""

    async def waiting() -> bool:
        cur = await db.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type ="
            " 'Lock' AND application_name = 'corral-supervisor'")
        row = await cur.fetchone()
        return row is not None and row[0] == 1
    await eventually(waiting, timeout_s=10, what=what)


def empty_pg(url: str) -> None:
    """Remove every row (and reset the ids) of a PostgreSQL store's tables, if present."""
    with psycopg.connect(url, autocommit=True) as conn:
        present = conn.execute("SELECT to_regclass('sessions') IS NOT NULL").fetchone()
        if present and present[0]:
            conn.execute(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY".encode())


async def open_backend(request: pytest.FixtureRequest, backend: str, tmp_path: Path, *,
                       fresh: bool = True, **options: Any) -> SessionStore:
    """The backend's store: SQLite at tmp_path/corral.db, or the worker's PostgreSQL
    database (emptied first when ``fresh``; ``fresh=False`` reopens what is there)."""
    if backend == "sqlite":
        os.makedirs(tmp_path, exist_ok=True)
        return await Store.open(tmp_path / "corral.db", **options)
    url: str = request.getfixturevalue("pg_database")
    if fresh:
        empty_pg(url)
    return await PgStore.open(url, **options)


def stored_bytes(store: SessionStore) -> int:
    """Bytes the store's data takes: SQLite pages in use, or PostgreSQL relation sizes."""
    if isinstance(store, Store):
        with closing(sqlite3.connect(store.path)) as raw:
            pages = raw.execute("PRAGMA page_count").fetchone()[0]
            size = raw.execute("PRAGMA page_size").fetchone()[0]
        return int(pages) * int(size)
    assert isinstance(store, PgStore)
    with psycopg.connect(store.url) as conn:
        row = conn.execute("SELECT sum(pg_total_relation_size(c.oid)) FROM pg_class c"
                           " JOIN pg_namespace n ON n.oid = c.relnamespace"
                           " WHERE n.nspname = 'public' AND c.relkind = 'r'").fetchone()
        return int(row[0]) if row and row[0] is not None else 0


def state_bytes(store: SessionStore) -> int:
    """The largest checkpoint state row, in bytes."""
    query = "SELECT max(length(state)) FROM checkpoint_state"
    if isinstance(store, Store):
        with closing(sqlite3.connect(store.path)) as raw:
            return int(raw.execute(query).fetchone()[0])
    assert isinstance(store, PgStore)
    with psycopg.connect(store.url) as conn:
        row = conn.execute(query).fetchone()
        return int(row[0]) if row else 0


def row_count(store: SessionStore, table: str) -> int:
    """Rows in one of the store's tables, read outside the store."""
    if table not in TABLES:
        raise ValueError(table)
    if isinstance(store, Store):
        with closing(sqlite3.connect(store.path)) as raw:
            return int(raw.execute(f"SELECT count(*) FROM {table}").fetchone()[0])
    assert isinstance(store, PgStore)
    with psycopg.connect(store.url) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table}".encode()).fetchone()
        return int(row[0]) if row else 0


def rows(store: SessionStore, query: str) -> list[tuple[Any, ...]]:
    """The rows of a query (a test's own constant) read outside the store."""
    if isinstance(store, Store):
        with closing(sqlite3.connect(store.path)) as raw:
            return [tuple(r) for r in raw.execute(query).fetchall()]
    assert isinstance(store, PgStore)
    with psycopg.connect(store.url) as conn:
        return [tuple(r) for r in conn.execute(query.encode()).fetchall()]
