"""The one boundary where ``psycopg.Error`` becomes a store error (``raise ... from exc``).

| psycopg error (SQLSTATE)                                   | store error        |
|------------------------------------------------------------|--------------------|
| connection failed, lost, or an admin shutdown (08xxx, 57P0x) | StoreUnavailable  |
| serialization failure, deadlock, lock or statement timeout | StoreBusy          |
| disk full (53100), out of memory (53200)                   | StoreFull          |
| data corrupted (XX001, XX002)                              | StoreCorrupt       |
| insufficient privilege (42501)                             | StoreError, saying what to grant |
| a NUL byte in text, bad encoding (22xxx)                   | InvalidRequest     |
| anything else                                              | StoreError         |

Invariant: a message never holds a password; the URL is always shown ``redact``ed.
"""

from __future__ import annotations

import psycopg
from psycopg import errors as pgerr

from supervisor.store.errors import (
    InvalidRequest,
    StoreBusy,
    StoreCorrupt,
    StoreError,
    StoreFull,
    StoreUnavailable,
)

_BUSY = (pgerr.SerializationFailure, pgerr.DeadlockDetected, pgerr.LockNotAvailable,
         pgerr.QueryCanceled)
_UNAVAILABLE = (pgerr.AdminShutdown, pgerr.CrashShutdown, pgerr.CannotConnectNow,
                pgerr.ConnectionException)


def is_unavailable(exc: BaseException) -> bool:
    """The server is gone or the connection broke (not a statement's own failure)."""
    return isinstance(exc, psycopg.OperationalError) and (
        isinstance(exc, _UNAVAILABLE) or exc.sqlstate is None
    )


def translate(exc: psycopg.Error, what: str, shown_url: str) -> StoreError:
    """Map a psycopg error to a store error (the caller raises it ``from exc``)."""
    state = exc.sqlstate or ""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if is_unavailable(exc):
        return StoreUnavailable(f"{what}: PostgreSQL at {shown_url} is unreachable ({first})")
    if isinstance(exc, _BUSY):
        return StoreBusy(f"{what}: {first} ({state})")
    if isinstance(exc, pgerr.DiskFull | pgerr.OutOfMemory | pgerr.InsufficientResources):
        return StoreFull(f"{what}: {first} ({state}); the transaction was rolled back")
    if isinstance(exc, pgerr.DataCorrupted | pgerr.IndexCorrupted):
        return StoreCorrupt(f"{what}: {first} ({state})")
    if isinstance(exc, psycopg.DataError) or state.startswith("22"):
        return InvalidRequest(f"{what}: {first}")
    if isinstance(exc, pgerr.InsufficientPrivilege):
        return StoreError(f"{what}: {first} ({state}); the role in [store] url lacks a "
                          "privilege Corral needs (creating and writing its tables): give it "
                          "a database of its own, e.g. CREATE DATABASE corral OWNER ROLE")
    return StoreError(f"{what}: {type(exc).__name__}: {first}")
