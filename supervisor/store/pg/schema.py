"""The PostgreSQL schema of the store and its ordered, versioned migrations.

Same tables and columns as the SQLite schema (``supervisor.store.schema``, same version
numbers), with PostgreSQL keys: the keyed tables have a composite primary key
``(sid, sequence)`` / ``(sid, epoch)`` instead of SQLite's packed rowid, and ids are
identity columns; session ids sort by bytes (``COLLATE "C"``) as in SQLite. JSON stays
compact UTF-8 TEXT (the same bytes the SQLite store writes), so idempotent re-writes
compare equal on both and exports are identical.

Invariants:
- ``schema_version`` holds one row per applied migration; the newest is the version.
- A database is used only at exactly ``SCHEMA_VERSION``. An empty database (no
  ``schema_version`` table) is created at open; one at another version is refused
  (``SchemaMismatch``) naming the command that migrates it: several supervisors share
  it, so a migration is an operator's act (``corral store migrate``), never a side
  effect of one supervisor starting.
- Every migration (and the creation) runs in one transaction holding a transaction-level
  advisory lock, so concurrent starts and migrations serialize; a crash mid-migration
  leaves the previous version.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from typing import Any

import psycopg

from supervisor.store.errors import SchemaMismatch, SchemaTooNew, StoreError
from supervisor.store.schema import Migration

log = logging.getLogger(__name__)

Conn = psycopg.AsyncConnection[tuple[Any, ...]]

# pg_advisory_xact_lock key of schema changes: "corral" in ASCII.
MIGRATION_LOCK = 0x636F7272616C

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "initial schema: sessions, state, transcript, rewrites, events, executions",
        (
            """CREATE TABLE sessions (
                sid BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                session_id TEXT COLLATE "C" NOT NULL UNIQUE,
                created_at DOUBLE PRECISION NOT NULL,
                config TEXT NOT NULL,
                route TEXT,
                workspace TEXT,
                tenant TEXT,
                parent_session_id TEXT,
                fork_sequence BIGINT,
                status TEXT NOT NULL CHECK (status IN ('active', 'closed'))
            )""",
            "CREATE INDEX sessions_by_status ON sessions (status, session_id)",
            """CREATE TABLE checkpoint_state (
                sid BIGINT PRIMARY KEY,
                updated_at DOUBLE PRECISION NOT NULL,
                next_event_sequence BIGINT NOT NULL,
                next_batch_sequence BIGINT NOT NULL,
                state TEXT NOT NULL
            )""",
            """CREATE TABLE transcript_batches (
                sid BIGINT NOT NULL,
                sequence BIGINT NOT NULL,
                epoch BIGINT NOT NULL,
                created_at DOUBLE PRECISION NOT NULL,
                items TEXT NOT NULL,
                PRIMARY KEY (sid, sequence)
            )""",
            """CREATE TABLE context_rewrites (
                sid BIGINT NOT NULL,
                epoch BIGINT NOT NULL,
                at_batch BIGINT NOT NULL,
                reasons TEXT NOT NULL,
                created_at DOUBLE PRECISION NOT NULL,
                items TEXT NOT NULL,
                PRIMARY KEY (sid, epoch)
            )""",
            """CREATE TABLE events (
                sid BIGINT NOT NULL,
                sequence BIGINT NOT NULL,
                type TEXT NOT NULL,
                submission_id TEXT,
                created_at DOUBLE PRECISION NOT NULL,
                payload TEXT NOT NULL,
                PRIMARY KEY (sid, sequence)
            )""",
            """CREATE TABLE executions (
                id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                sid BIGINT NOT NULL,
                turn_id TEXT NOT NULL,
                outcome TEXT NOT NULL,
                model_calls BIGINT NOT NULL,
                tool_calls BIGINT NOT NULL,
                failed_tool_calls BIGINT NOT NULL,
                usage TEXT NOT NULL,
                started_at DOUBLE PRECISION NOT NULL,
                ended_at DOUBLE PRECISION,
                elapsed_s DOUBLE PRECISION,
                sandbox_tier TEXT,
                reason TEXT,
                UNIQUE (sid, turn_id)
            )""",
            "CREATE INDEX executions_by_session ON executions (sid, id)",
        ),
    ),
    Migration(
        2,
        "supervisors and session leases (owner, fencing epoch, expiry)",
        (
            """CREATE TABLE supervisors (
                supervisor_id TEXT PRIMARY KEY,
                address TEXT NOT NULL,
                host TEXT NOT NULL,
                pid BIGINT NOT NULL,
                started_at DOUBLE PRECISION NOT NULL,
                heartbeat_at DOUBLE PRECISION NOT NULL
            )""",
            """CREATE TABLE leases (
                sid BIGINT PRIMARY KEY,
                owner TEXT,
                epoch BIGINT NOT NULL,
                expires_at DOUBLE PRECISION NOT NULL
            )""",
            "CREATE INDEX leases_by_owner ON leases (owner)",
        ),
    ),
    Migration(
        3,
        "events record the lease (owner, fencing epoch) they were written under",
        (
            # NULL without leases (one supervisor); evidence for the chaos checker's
            # ``fencing`` invariant (docs/chaos.md): per session, epochs never go back.
            "ALTER TABLE events ADD COLUMN lease_owner TEXT",
            "ALTER TABLE events ADD COLUMN lease_epoch BIGINT",
        ),
    ),
)
SCHEMA_VERSION = MIGRATIONS[-1].version
_VERSION_TABLE = (
    "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY,"
    " applied_at DOUBLE PRECISION NOT NULL, description TEXT NOT NULL)"
)


async def current_version(conn: Conn) -> int | None:
    """The newest applied version; None for a database without a ``schema_version``."""
    cur = await conn.execute("SELECT to_regclass('schema_version') IS NOT NULL")
    row = await cur.fetchone()
    if row is None or not row[0]:
        return None
    cur = await conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version")
    row = await cur.fetchone()
    return int(row[0]) if row is not None else 0


async def _apply(conn: Conn,
                 migrations: Sequence[Migration], found: int) -> int:
    version = found
    for migration in migrations:
        if migration.version <= found:
            continue
        for statement in migration.statements:
            await conn.execute(statement.encode())
        await conn.execute(
            "INSERT INTO schema_version (version, applied_at, description) VALUES (%s,%s,%s)",
            (migration.version, time.time(), migration.description),
        )
        version = migration.version
        log.info("store schema migrated to version %d (%s)", version, migration.description)
    return version


def _tables(migrations: Sequence[Migration]) -> list[str]:
    """The tables the migrations create."""
    return sorted({m.group(1) for migration in migrations for statement in migration.statements
                   for m in [re.match(r"\s*CREATE TABLE (\w+)", statement)] if m})


async def _refuse_foreign(conn: Conn, where: str, migrations: Sequence[Migration]) -> None:
    """A database without ``schema_version`` that already holds a table of Corral's names
    belongs to something else: refused, saying so (creating the schema would fail on a
    bare DuplicateTable, or worse, write into another application's table)."""
    cur = await conn.execute("SELECT table_name FROM information_schema.tables WHERE "
                             "table_schema = current_schema() AND table_name = ANY(%s)",
                             (_tables(migrations),))
    clash = sorted(str(r[0]) for r in await cur.fetchall())
    if clash:
        raise StoreError(f"the database at {where} holds no Corral schema (no schema_version "
                         f"table) but has tables of the same names ({', '.join(clash)}): it "
                         "belongs to something else; give Corral a database of its own "
                         "(CREATE DATABASE corral) and name it in [store] url")


async def ensure(conn: Conn, *, where: str,
                 command: str, migrations: Sequence[Migration] = MIGRATIONS) -> int:
    """At open: create the schema in an empty database, accept exactly the newest version,
    refuse any other (``SchemaMismatch``, naming ``command``). Returns the version."""
    supported = migrations[-1].version
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        found = await current_version(conn)
        if found is None:
            await _refuse_foreign(conn, where, migrations)
            await conn.execute(_VERSION_TABLE)
            return await _apply(conn, migrations, 0)
    if found != supported:
        raise SchemaMismatch(found, supported, where, command)
    return found


async def migrate(conn: Conn, *, where: str = "this URL",
                  migrations: Sequence[Migration] = MIGRATIONS) -> tuple[int, int]:
    """Apply the missing migrations in order (the operator's command). Returns
    (version before, version after); refuses a newer database (``SchemaTooNew``)."""
    supported = migrations[-1].version
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        found = await current_version(conn)
        if found is None:
            await _refuse_foreign(conn, where, migrations)
            await conn.execute(_VERSION_TABLE)
            found = 0
        if found > supported:
            raise SchemaTooNew(found, supported)
        return found, await _apply(conn, migrations, found)
