"""Schema versioning and connection settings on real SQLite files."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from supervisor.store import SCHEMA_VERSION, InvalidRequest, SchemaTooNew, Store, StoreCorrupt
from supervisor.store.schema import MIGRATIONS, Migration, connect, migrate
from tests.store.steps import Session, new_record, tool_round


async def _open_and_close(path: Path) -> None:
    store = await Store.open(path)
    await store.close()


async def test_fresh_database_is_migrated_and_in_wal(tmp_path: Path) -> None:
    path = tmp_path / "corral.db"
    store = await Store.open(path)
    await store.close()
    with closing(sqlite3.connect(path)) as raw:
        versions = [r[0] for r in raw.execute("SELECT version FROM schema_version ORDER BY 1")]
        assert versions == [m.version for m in MIGRATIONS]
        assert versions[-1] == SCHEMA_VERSION
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        tables = {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"sessions", "checkpoint_state", "transcript_batches", "context_rewrites",
            "events", "executions", "schema_version"} <= tables


async def test_reopen_does_not_migrate_again(tmp_path: Path) -> None:
    path = tmp_path / "corral.db"
    for _ in range(3):
        store = await Store.open(path)
        await store.close()
    with closing(sqlite3.connect(path)) as raw:
        assert raw.execute("SELECT count(*) FROM schema_version").fetchone()[0] == len(MIGRATIONS)


async def test_newer_schema_is_refused_with_both_versions(tmp_path: Path) -> None:
    path = tmp_path / "corral.db"
    store = await Store.open(path)
    await store.close()
    with closing(sqlite3.connect(path)) as raw:
        raw.execute("INSERT INTO schema_version VALUES (?, 0, 'from the future')",
                    (SCHEMA_VERSION + 5,))
        raw.commit()
    with pytest.raises(SchemaTooNew) as info:
        await _open_and_close(path)
    assert info.value.found == SCHEMA_VERSION + 5
    assert info.value.supported == SCHEMA_VERSION
    assert f"{SCHEMA_VERSION + 5}" in str(info.value)
    assert f"{SCHEMA_VERSION}" in str(info.value)


async def test_later_migrations_apply_in_order_to_an_existing_database(tmp_path: Path) -> None:
    path = tmp_path / "corral.db"
    s = Session("s1")
    store = await Store.open(path)
    await store.create_session(new_record("s1"))
    await store.commit(s.step(tool_round(1)))
    await store.close()
    extra = (
        *MIGRATIONS,
        Migration(SCHEMA_VERSION + 1, "add a notes table", ("CREATE TABLE notes (x TEXT)",)),
        Migration(SCHEMA_VERSION + 2, "add a column to it",
                  ("ALTER TABLE notes ADD COLUMN y INTEGER",)),
    )
    conn = connect(path, synchronous="NORMAL")
    try:
        assert migrate(conn, extra) == SCHEMA_VERSION + 2
        cols = [r[1] for r in conn.execute("PRAGMA table_info(notes)")]
        assert cols == ["x", "y"]
        assert [r[0] for r in conn.execute("SELECT version FROM schema_version ORDER BY 1")] \
            == [m.version for m in extra]
    finally:
        conn.close()
    # The data written under version 1 is untouched; the plain store (which only knows
    # version 1) now refuses the upgraded file.
    with pytest.raises(SchemaTooNew):
        await _open_and_close(path)


@pytest.mark.parametrize("mode", ["NORMAL", "FULL"])
async def test_synchronous_setting_is_applied(tmp_path: Path, mode: str) -> None:
    path = tmp_path / "corral.db"
    conn = connect(path, synchronous=mode)
    try:
        # PRAGMA synchronous reports 1 for NORMAL, 2 for FULL.
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == {"NORMAL": 1, "FULL": 2}[mode]
    finally:
        conn.close()
    store = await Store.open(path, synchronous=mode)
    s = Session("s1")
    await store.create_session(new_record("s1"))
    await store.commit(s.step(tool_round(1)))
    await store.close()


async def test_a_file_that_is_not_a_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "corral.db"
    path.write_bytes(b"this is not an SQLite database, just some bytes\n" * 100)
    with pytest.raises(StoreCorrupt, match="not a database"):
        await _open_and_close(path)
    with pytest.raises(InvalidRequest, match="synchronous"):
        await Store.open(tmp_path / "other.db", synchronous="OFF")
