"""The store's SQLite schema, its ordered migrations, and connection setup.

Schema (version 3; version 1 lacked ``supervisors`` and ``leases``, version 2 the
events' ``lease_owner`` / ``lease_epoch``)::

    schema_version      one row per applied migration (version, applied_at, description)
    sessions            sid INTEGER PRIMARY KEY, session_id UNIQUE, config JSON, route,
                        workspace, tenant, parent_session_id, fork_sequence, status
    checkpoint_state    one small row per session (rowid = sid): next_event_sequence,
                        next_batch_sequence (copied out for the no-regression guard),
                        CheckpointState JSON
    transcript_batches  append-only (rowid = key(sid, sequence)): epoch, created_at, items JSON
    context_rewrites    written only on compaction/rollback/fork (rowid = key(sid, epoch)):
                        at_batch, reasons JSON, items JSON
    events              the event journal (rowid = key(sid, sequence)): type,
                        submission_id, created_at, payload JSON; (v3) lease_owner,
                        lease_epoch: the lease it was written under (NULL here)
    executions          one row per turn, upserted by UNIQUE(sid, turn_id); rowid orders pages
    supervisors         (v2) one row per supervisor sharing the store: address, heartbeat
    leases              (v2) one row per session (rowid = sid): owner, epoch, expires_at

Invariants:
- Tables keyed by (session, sequence) store that pair packed into the rowid
  (``key(sid, n) = sid << 32 | n``), so the table b-tree IS the key index: an append
  dirties one leaf of one b-tree, not a table page plus an index page. Range scans of
  one session are rowid ranges. Sequences and epochs must be in [0, 2**32).
- Migrations are applied in order, each in its own transaction together with its
  ``schema_version`` row, so a crash mid-migration leaves the previous version intact.
- A database whose newest ``schema_version`` is above ``SCHEMA_VERSION`` is refused
  (``SchemaTooNew``) before anything is written to it.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from supervisor.store.errors import InvalidRequest, SchemaTooNew, translate_sqlite_error

log = logging.getLogger(__name__)

KEY_BITS = 32
KEY_LIMIT = 1 << KEY_BITS
# OFF is refused: without syncs at all a power loss can corrupt the file.
SYNCHRONOUS_MODES = ("NORMAL", "FULL", "EXTRA")
DEFAULT_SYNCHRONOUS = "NORMAL"
# 8 KiB pages: a step's rows (a 2-4 KiB batch, 1-2 KiB events) pack denser than in
# 4 KiB pages (store bench: write amplification 2.48 vs 3.17), for ~38% more WAL bytes.
PAGE_SIZE = 8192
BUSY_TIMEOUT_MS = 20  # SQLite's own short wait; the store adds backoff up to its deadline


def key(sid: int, n: int) -> int:
    """The rowid of (session, sequence-or-epoch)."""
    if not 0 <= n < KEY_LIMIT:
        raise InvalidRequest(f"sequence {n} out of range [0, 2**32)")
    return (sid << KEY_BITS) | n


def key_range(sid: int) -> tuple[int, int]:
    """Inclusive rowid bounds of one session's rows."""
    return sid << KEY_BITS, (sid << KEY_BITS) | (KEY_LIMIT - 1)


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    description: str
    statements: tuple[str, ...]


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "initial schema: sessions, state, transcript, rewrites, events, executions",
        (
            """CREATE TABLE sessions (
                sid INTEGER PRIMARY KEY,
                session_id TEXT NOT NULL UNIQUE,
                created_at REAL NOT NULL,
                config TEXT NOT NULL,
                route TEXT,
                workspace TEXT,
                tenant TEXT,
                parent_session_id TEXT,
                fork_sequence INTEGER,
                status TEXT NOT NULL CHECK (status IN ('active', 'closed'))
            )""",
            "CREATE INDEX sessions_by_status ON sessions (status, session_id)",
            """CREATE TABLE checkpoint_state (
                sid INTEGER PRIMARY KEY,
                updated_at REAL NOT NULL,
                next_event_sequence INTEGER NOT NULL,
                next_batch_sequence INTEGER NOT NULL,
                state TEXT NOT NULL
            )""",
            """CREATE TABLE transcript_batches (
                k INTEGER PRIMARY KEY,
                sequence INTEGER NOT NULL,
                epoch INTEGER NOT NULL,
                created_at REAL NOT NULL,
                items TEXT NOT NULL
            )""",
            """CREATE TABLE context_rewrites (
                k INTEGER PRIMARY KEY,
                epoch INTEGER NOT NULL,
                at_batch INTEGER NOT NULL,
                reasons TEXT NOT NULL,
                created_at REAL NOT NULL,
                items TEXT NOT NULL
            )""",
            """CREATE TABLE events (
                k INTEGER PRIMARY KEY,
                sequence INTEGER NOT NULL,
                type TEXT NOT NULL,
                submission_id TEXT,
                created_at REAL NOT NULL,
                payload TEXT NOT NULL
            )""",
            """CREATE TABLE executions (
                id INTEGER PRIMARY KEY,
                sid INTEGER NOT NULL,
                turn_id TEXT NOT NULL,
                outcome TEXT NOT NULL,
                model_calls INTEGER NOT NULL,
                tool_calls INTEGER NOT NULL,
                failed_tool_calls INTEGER NOT NULL,
                usage TEXT NOT NULL,
                started_at REAL NOT NULL,
                ended_at REAL,
                elapsed_s REAL,
                sandbox_tier TEXT,
                reason TEXT,
                UNIQUE (sid, turn_id)
            )""",
            # Entries are ordered by (sid, rowid): newest-first execution pages per session.
            "CREATE INDEX executions_by_session ON executions (sid)",
        ),
    ),
    Migration(
        2,
        "supervisors and session leases (owner, fencing epoch, expiry)",
        (
            # One row per supervisor process sharing the store (docs/multihost.md).
            """CREATE TABLE supervisors (
                supervisor_id TEXT PRIMARY KEY,
                address TEXT NOT NULL,
                host TEXT NOT NULL,
                pid INTEGER NOT NULL,
                started_at REAL NOT NULL,
                heartbeat_at REAL NOT NULL
            )""",
            # One row per session ever owned: epoch only grows (the fencing token).
            """CREATE TABLE leases (
                sid INTEGER PRIMARY KEY,
                owner TEXT,
                epoch INTEGER NOT NULL,
                expires_at REAL NOT NULL
            )""",
        ),
    ),
    Migration(
        3,
        "events record the lease (owner, fencing epoch) they were written under",
        (
            # Always NULL here (SQLite has one supervisor, no leases); the column keeps
            # the two schemas alike (pg/schema.py writes the lease in lease mode).
            "ALTER TABLE events ADD COLUMN lease_owner TEXT",
            "ALTER TABLE events ADD COLUMN lease_epoch INTEGER",
        ),
    ),
)
SCHEMA_VERSION = MIGRATIONS[-1].version


def check_synchronous(synchronous: str) -> str:
    sync = str(synchronous).upper()
    if sync not in SYNCHRONOUS_MODES:
        raise InvalidRequest(f"synchronous must be one of {SYNCHRONOUS_MODES}, not {synchronous!r}")
    return sync


def open_raw(path: Path) -> sqlite3.Connection:
    """Open a connection (autocommit: the store issues its own BEGINs); reads nothing yet."""
    try:
        return sqlite3.connect(
            str(path), isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_MS / 1000
        )
    except sqlite3.Error as exc:
        raise translate_sqlite_error(exc, f"opening {path}") from exc


def configure(conn: sqlite3.Connection, synchronous: str) -> None:
    """Set the store's connection settings (WAL, synchronous, page size of a new file)."""
    sync = check_synchronous(synchronous)
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        # Only takes effect on a new, empty database (before WAL mode writes its header).
        conn.execute(f"PRAGMA page_size = {PAGE_SIZE}")
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            log.warning("could not switch to WAL (journal_mode=%s)", mode)
        conn.execute(f"PRAGMA synchronous = {sync}")
        conn.execute("PRAGMA foreign_keys = OFF")
        conn.execute("PRAGMA temp_store = MEMORY")
    except sqlite3.Error as exc:
        raise translate_sqlite_error(exc, "configuring the connection") from exc


def connect(path: Path, *, synchronous: str) -> sqlite3.Connection:
    """Open one connection configured the store's way (a synchronous helper for tools)."""
    conn = open_raw(path)
    try:
        configure(conn, synchronous)
    except BaseException:
        conn.close()
        raise
    return conn


def current_version(conn: sqlite3.Connection) -> int:
    row = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'"
    ).fetchone()
    if row is None:
        return 0
    (version,) = conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone()
    return int(version)


def migrate(conn: sqlite3.Connection, migrations: Sequence[Migration] = MIGRATIONS) -> int:
    """Bring the database to the newest version in ``migrations``; return that version.

    Refuses (``SchemaTooNew``) a database newer than the newest migration known here.
    """
    supported = migrations[-1].version
    try:
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_version ("
                " version INTEGER PRIMARY KEY, applied_at REAL NOT NULL,"
                " description TEXT NOT NULL)"
            )
            found = current_version(conn)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        if found > supported:
            raise SchemaTooNew(found, supported)
        for migration in migrations:
            if migration.version <= found:
                continue
            conn.execute("BEGIN IMMEDIATE")
            try:
                # Re-check under the write lock: another process may have migrated meanwhile.
                if current_version(conn) >= migration.version:
                    conn.execute("ROLLBACK")
                    continue
                for statement in migration.statements:
                    conn.execute(statement)
                conn.execute(
                    "INSERT INTO schema_version (version, applied_at, description) VALUES (?,?,?)",
                    (migration.version, time.time(), migration.description),
                )
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            log.info("store schema migrated to version %d (%s)", migration.version,
                     migration.description)
    except sqlite3.Error as exc:
        raise translate_sqlite_error(exc, "migrating the store schema") from exc
    return supported
