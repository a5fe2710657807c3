"""Versioned schema migrations on both stores: an old SQLite store opens and migrates;
a PostgreSQL store at another version is refused with the command that migrates it,
and that command (a real ``corral store migrate``) does."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from contextlib import closing
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
import pytest

from supervisor.store import SchemaMismatch, SessionId, Store
from supervisor.store import schema as sqlite_schema
from supervisor.store import writer as sqlite_writer
from supervisor.store.codec import Limits, encode
from supervisor.store.pg import schema as pg_schema
from supervisor.store.pg import writer as pg_writer
from supervisor.store.pg.store import PgStore, connect
from supervisor.store.records import SessionRecord
from tests.store.steps import Session, new_record, tool_round

pytestmark = pytest.mark.timeout(90)


def _first_steps() -> tuple[SessionRecord, str, Any]:
    record = new_record("old")
    config = encode(record.config, what="config", limit=1 << 20)
    step = sqlite_writer.prepare_step(
        Session("old").step(tool_round(1), events=[("turn_started", {})]), Limits())
    return record, config, step


def _corral(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor.cli", *args], capture_output=True,
                          text=True, timeout=60)


def test_both_stores_have_the_same_versions_and_tables(tmp_path: Path) -> None:
    assert [m.version for m in sqlite_schema.MIGRATIONS] == \
        [m.version for m in pg_schema.MIGRATIONS]
    assert [m.description for m in sqlite_schema.MIGRATIONS] == \
        [m.description for m in pg_schema.MIGRATIONS]
    for a, b in zip(sqlite_schema.MIGRATIONS, pg_schema.MIGRATIONS, strict=True):
        def tables(m: Any) -> list[str]:
            return sorted(s.split()[2] for s in m.statements if s.startswith("CREATE TABLE"))
        assert tables(a) == tables(b), a.version


async def test_an_old_sqlite_store_opens_and_migrates(tmp_path: Path) -> None:
    path = tmp_path / "corral.db"
    record, config, step = _first_steps()
    with closing(sqlite_schema.connect(path, synchronous="NORMAL")) as conn:
        assert sqlite_schema.migrate(conn, sqlite_schema.MIGRATIONS[:1]) == 1
        sids = sqlite_writer.Sids()
        sqlite_writer.apply_group(conn, sids, [
            partial(lambda c, s: sqlite_writer.create_session(c, s, record, config, step))])
    store = await Store.open(path)
    try:
        loaded = await store.load(SessionId("old"))
        assert loaded is not None
        assert loaded.context == tool_round(1)
        assert loaded.last_event_sequence == 1
    finally:
        await store.close()
    with closing(sqlite3.connect(path)) as raw:
        assert [r[0] for r in raw.execute("SELECT version FROM schema_version ORDER BY 1")] \
            == [1, 2, 3]
        assert raw.execute("SELECT count(*) FROM leases").fetchone()[0] == 0


async def test_an_old_postgresql_store_is_refused_until_migrated(
    pg_server: Any, tmp_path: Path
) -> None:
    url = pg_server.new_database()
    try:
        record, config, step = _first_steps()
        conn = await connect(url, timeout_s=10, what="test")
        try:
            await pg_schema.migrate(conn, migrations=pg_schema.MIGRATIONS[:1])
            await pg_writer.apply_group(conn, [
                lambda c: pg_writer.create_session(c, record, config, step)])
        finally:
            await conn.close()
        home = tmp_path / "home"
        home.mkdir()
        (home / "corral.toml").write_text(f'[store]\nurl = "{url}"\n')
        from supervisor.store.opening import open_for_home

        with pytest.raises(SchemaMismatch) as info:
            await open_for_home(home)
        assert (info.value.found, info.value.supported) == (1, 3)
        assert f"migrate it first with: corral store migrate --home {home}" in str(info.value)
        assert pg_server.password not in str(info.value)

        out = _corral("store", "migrate", "--home", str(home))
        assert out.returncode == 0, out.stderr
        assert "migrated from schema version 1 to 3" in out.stdout
        assert pg_server.password not in out.stdout + out.stderr
        again = _corral("store", "migrate", "--home", str(home), "--json")
        assert '"from_version": 3' in again.stdout

        store = await open_for_home(home)
        try:
            loaded = await store.load(SessionId("old"))
            assert loaded is not None
            assert loaded.context == tool_round(1)
        finally:
            await store.close()
    finally:
        pg_server.drop_database(url)


async def test_a_newer_postgresql_store_is_refused_and_not_touched(pg_server: Any) -> None:
    url = pg_server.new_database()
    try:
        store = await PgStore.open(url)
        await store.close()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("INSERT INTO schema_version VALUES (7, 0, 'from the future')")
        with pytest.raises(SchemaMismatch, match="has schema version 7, this Corral needs 3; "
                           "upgrade Corral"):
            await PgStore.open(url)
        from supervisor.store.errors import SchemaTooNew
        from supervisor.store.migrating import migrate_pg

        with pytest.raises(SchemaTooNew):
            await migrate_pg(url)
        with psycopg.connect(url) as conn:
            row = conn.execute("SELECT max(version), count(*) FROM schema_version").fetchone()
        assert row == (7, 4)
    finally:
        pg_server.drop_database(url)
