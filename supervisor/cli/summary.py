"""One session's summary for ``corral sessions``, from either store's rows, and the
errors of reading a store from the CLI (shared by ``sessions`` for SQLite and
``pgsessions`` for PostgreSQL, so neither imports the other)."""

from __future__ import annotations

from typing import Any


class StoreUnreadable(Exception):
    """The farm's store cannot be read (locked, corrupt); the message says why."""


class NoStore(StoreUnreadable):
    """The home has no store yet: no session was ever created there."""


def summarize(row: tuple[Any, ...], state_row: tuple[Any, ...] | None, turns: int | None,
              last_turn_at: float | None, last: tuple[Any, ...] | None,
              last_event_at: float | None, *, running: bool, default_route: str,
              owner: dict[str, Any] | None = None) -> dict[str, Any]:
    """One session's summary from what either store holds (``row``: the session's
    columns, ``reader.SESSION_COLUMNS``). ``running``: a turn in progress is running (a
    farm runs here; on PostgreSQL: a supervisor holds the session's live lease), else
    suspended. ``owner``: the live lease (PostgreSQL), shown as is."""
    from supervisor.store import reader
    from supervisor.store.codec import decode
    from supervisor.store.records import CheckpointState

    record = reader.to_session(row)
    state = CheckpointState.from_json(decode(state_row[1])) if state_row else CheckpointState()
    times = [record.created_at, state_row[0] if state_row else None,
             last_turn_at, last_event_at]
    if record.status != "active":
        status = "terminated"
    elif state.pending_approval is not None:
        status = "waiting_for_approval"
    elif state.active_turn is not None:
        status = "running" if running else "suspended"
    elif last is not None and last[0] == "failed":
        status = "failed"
    else:
        status = "idle"
    config = record.config if isinstance(record.config, dict) else {}
    return {
        "session_id": record.session_id,
        "state": status,
        "created_at": record.created_at,
        "last_active_at": max(t for t in times if isinstance(t, int | float)),
        "turns": int(turns or 0),
        "last_turn": {"outcome": last[0], "reason": last[1]} if last else None,
        "route": state.route or config.get("route") or default_route,
        "workspace": config.get("workspace"),
        "tenant": config.get("tenant"),
        "parent_session_id": record.parent_session_id,
        "pending_approval": (state.pending_approval or {}).get("id"),
        "owner": owner,
    }
