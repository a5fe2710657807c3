"""Which store a process opens: SQLite at a path (the default) or PostgreSQL at a URL.

``open_store(db=..., url=...)`` is the one place that chooses; ``open_for_home(home)``
reads ``[store] url`` from the farm's corral.toml (no url: ``HOME/corral.db``). psycopg is
imported only when a URL is given, so a SQLite farm never loads it.

Invariant: every caller gets a ``SessionStore``; nothing outside ``supervisor.store``
needs to know which implementation it holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from supervisor.store.port import SessionStore
from supervisor.store.store import Store


async def open_store(*, db: Path | None = None, url: str | None = None,
                     home: Path | None = None, **options: Any) -> SessionStore:
    """PostgreSQL when ``url`` is given, else SQLite at ``db``. ``options`` are passed to
    the implementation's ``open`` (``limits``, ``max_group_ops``, ...); ``home`` names
    the farm in the migration command a refused PostgreSQL schema asks for."""
    if url is not None:
        from supervisor.store.migrating import migrate_command
        from supervisor.store.pg.store import MIGRATE_COMMAND, PgStore

        command = migrate_command(home) if home is not None else MIGRATE_COMMAND
        return await PgStore.open(url, migrate_command=command, **options)
    if db is None:
        raise ValueError("open_store needs a database path or a store url")
    return await Store.open(db, **options)


def configured_url(home: Path) -> str | None:
    """The farm's ``[store] url`` (raises ``config.ConfigError`` on a bad corral.toml)."""
    from supervisor import config as config_mod

    return config_mod.load(home).store_url


async def open_for_home(home: Path, **options: Any) -> SessionStore:
    """The store the farm at ``home`` is configured with."""
    from supervisor.farm.layout import FarmPaths

    return await open_store(db=FarmPaths.of(home).db, url=configured_url(home), home=home,
                            **options)
