"""``corral store migrate``'s work: bring a store to this Corral's schema version.

SQLite stores migrate themselves when opened (one process owns the file); this gives
the same step explicitly. PostgreSQL stores never migrate on open (several supervisors
share them): an operator runs this once, and every supervisor then opens the store.

Invariant: each migration runs in its own transaction with its ``schema_version`` row
(SQLite: ``BEGIN IMMEDIATE``; PostgreSQL: under an advisory lock), so a crash or a
concurrent run leaves a consistent version; a store newer than this Corral is refused
(``SchemaTooNew``) and not touched.
"""

from __future__ import annotations

import asyncio
import sqlite3
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from supervisor.store import schema
from supervisor.store.errors import translate_sqlite_error


@dataclass(frozen=True, slots=True)
class Migrated:
    where: str
    before: int
    after: int


def migrate_sqlite(path: Path) -> Migrated:
    try:
        with closing(schema.connect(path, synchronous=schema.DEFAULT_SYNCHRONOUS)) as conn:
            before = schema.current_version(conn)
            after = schema.migrate(conn)
    except sqlite3.Error as exc:
        raise translate_sqlite_error(exc, f"migrating {path}") from exc
    return Migrated(str(path), before, after)


async def migrate_pg(url: str, *, timeout_s: float = 30.0) -> Migrated:
    import psycopg

    from supervisor.store.pg import schema as pg_schema
    from supervisor.store.pg.errors import translate
    from supervisor.store.pg.store import connect
    from supervisor.store.url import redact

    conn = await connect(url, timeout_s=timeout_s, what="migrating the store")
    try:
        async with asyncio.timeout(timeout_s * 10):
            before, after = await pg_schema.migrate(conn, where=redact(url))
    except psycopg.Error as exc:
        raise translate(exc, f"migrating the store at {redact(url)}", redact(url)) from exc
    finally:
        await conn.close()
    return Migrated(redact(url), before, after)


async def migrate_home(home: Path) -> Migrated:
    """Migrate the store the farm at ``home`` is configured with."""
    from supervisor.farm.layout import FarmPaths
    from supervisor.store.opening import configured_url

    url = configured_url(home)
    if url is not None:
        return await migrate_pg(url)
    paths = FarmPaths.of(home)
    paths.prepare()
    return await asyncio.to_thread(migrate_sqlite, paths.db)


def migrate_command(home: Path) -> str:
    """The command an operator runs to migrate the store of ``home``."""
    return f"corral store migrate --home {home}"
