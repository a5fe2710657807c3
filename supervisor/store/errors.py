"""Errors of the durable store. sqlite3 exceptions never leak past the store.

Exception tree::

    StoreError                  every store failure (a ``broker.protocol.Failed``)
    ├── SchemaTooNew            the database was written by a newer Corral (not retryable)
    ├── SchemaMismatch          a shared (PostgreSQL) database at another schema version:
    │                           refused at open, with the command that migrates it
    ├── LeaseLost               this supervisor no longer owns the session (its lease
    │                           expired or another supervisor took it: a newer fencing
    │                           epoch); the write was refused, nothing of it committed
    ├── StoreUnavailable        the database server cannot be reached (PostgreSQL down,
    │                           refused, timed out); the message names the URL without
    │                           its password (retryable)
    ├── StoreBusy               another connection held the write lock past the deadline
    │                           (retryable)
    ├── StoreFull               disk (or max_page_count) full; the transaction was rolled
    │                           back whole, nothing partial is on disk (retryable later)
    ├── StoreClosed             the store was closed
    ├── SessionNotFound         no session with that id
    ├── SessionExists           create_session or fork onto an existing id
    ├── RecordTooLarge          an item, payload or state row above its bound
    ├── SequenceConflict        a sequence gap, or a (session, sequence) already holding
    │                           different content (an engine bug, never retried)
    ├── InvalidRequest          bad arguments (unknown status, fork past the last batch, ...)
    └── StoreCorrupt            the database failed to open or an integrity check

``translate_sqlite_error`` is the one boundary where ``sqlite3.Error`` becomes one
of these (``raise ... from exc``); ``supervisor.store.pg.errors.translate`` is the
one for ``psycopg.Error``.
"""

from __future__ import annotations

import sqlite3

from broker.protocol import Failed


def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")


class StoreError(Failed):
    """Base of every store error; a ``broker.protocol.Failed`` whose ``kind`` is the
    class's stable snake_case name (``StoreBusy`` -> ``store_busy``)."""

    kind = "store_error"
    retryable: bool = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.kind = _snake(cls.__name__)


class SchemaTooNew(StoreError):
    def __init__(self, found: int, supported: int) -> None:
        super().__init__(
            f"database schema version {found} is newer than this Corral supports "
            f"(up to {supported}); upgrade Corral, or use another database"
        )
        self.found = found
        self.supported = supported


class SchemaMismatch(StoreError):
    def __init__(self, found: int, supported: int, where: str, command: str) -> None:
        if found > supported:
            advice = "upgrade Corral on this host"
        else:
            advice = f"migrate it first with: {command}"
        super().__init__(
            f"the store at {where} has schema version {found}, this Corral needs "
            f"{supported}; {advice}"
        )
        self.found = found
        self.supported = supported
        self.command = command


class LeaseLost(StoreError):
    pass


class StoreUnavailable(StoreError):
    retryable = True


class StoreBusy(StoreError):
    retryable = True


class StoreFull(StoreError):
    retryable = True


class StoreClosed(StoreError):
    pass


class SessionNotFound(StoreError):
    pass


class SessionExists(StoreError):
    pass


class RecordTooLarge(StoreError):
    pass


class SequenceConflict(StoreError):
    pass


class InvalidRequest(StoreError):
    pass


class StoreCorrupt(StoreError):
    pass


def is_busy(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        return (code & 0xFF) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    return "locked" in str(exc) or "busy" in str(exc)


def is_full(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        return (code & 0xFF) == sqlite3.SQLITE_FULL
    return "full" in str(exc)


def translate_sqlite_error(exc: sqlite3.Error, what: str) -> StoreError:
    """Map a sqlite3 error to a store error (the caller raises it ``from exc``)."""
    name = getattr(exc, "sqlite_errorname", type(exc).__name__)
    if is_busy(exc):
        return StoreBusy(f"{what}: database is busy ({name})")
    if is_full(exc):
        return StoreFull(f"{what}: database or disk is full ({name}); nothing was written")
    code = getattr(exc, "sqlite_errorcode", 0)
    if isinstance(code, int) and (code & 0xFF) in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB):
        return StoreCorrupt(f"{what}: database is corrupt or not a database ({name})")
    return StoreError(f"{what}: {name}: {exc}")
