"""``corral sessions``, ``show``, ``terminate`` and ``delete``.

``sessions`` and ``show`` read the farm's store **read-only** (SQLite
``mode=ro``; ``immutable=1`` when the farm is stopped and its WAL index is
gone), so they work the same with the farm running, stopped or crashed, and
never write to it. On PostgreSQL (``[store] url``) ``sessions`` reads the shared
store in a read-only transaction (``pgsessions``) and shows each session's
lease owner; ``show`` asks the running farm, or PostgreSQL when none runs.
A session's state is derived from what the store holds:

- ``terminated``: the session was shut down (``corral terminate``);
- ``waiting_for_approval``: its turn waits on a recorded approval request;
- ``running``: a turn is in progress (``suspended`` when no farm runs: the
  turn resumes when a farm starts on this home);
- ``failed``: its last turn failed; ``idle`` otherwise.

``terminate`` submits the session's ``shutdown`` op (the turn is interrupted,
the session is closed in the store and refuses every later op). ``delete``
removes the session's rows: through the running farm's supervisor (the
store's only writer) when one runs, else by opening the store itself.

The farm, store and client modules are imported by the functions that use
them, not with the parser (``corral --help`` stays light).

Invariants:
- Listing reads at most ``MAX_SCANNED`` sessions and says when it stopped.
- Every answer with ``--json`` is one JSON document with the same fields.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import sqlite3
import sys
import time
from argparse import Namespace
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

from supervisor.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    Subparsers,
    add_home,
    add_json,
)
from supervisor.cli.output import print_json, say_error
from supervisor.cli.render import Renderer, clean
from supervisor.cli.summary import NoStore, StoreUnreadable, summarize

MAX_SCANNED = 10_000
SESSION_STATES = ("running", "waiting_for_approval", "idle", "failed", "terminated",
                  "suspended")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}


def add_parsers(sub: Subparsers) -> None:
    p = sub.add_parser("sessions", help="list sessions with their state, times and turns",
                       description="List the sessions of the farm at HOME, most recently "
                       "active first, with created and last-active times, state, turns, "
                       "route and workspace. Reads the store read-only, so it works with "
                       "the farm stopped (a turn left running then shows as 'suspended': "
                       "it resumes when a farm starts). With [store] url (PostgreSQL) it "
                       "reads the shared store, from any host, and shows each session's "
                       "owner: the supervisor holding its live lease.")
    add_home(p)
    p.add_argument("--state", action="append", choices=SESSION_STATES, default=None,
                   help="only sessions in this state (repeat for several)")
    p.add_argument("--since", default=None,
                   help="only sessions active since then: a duration (90s, 30m, 2h, 7d) or "
                   "a date (2026-12-01 or 2026-12-01T10:00)")
    p.add_argument("--limit", type=int, default=100,
                   help="list at most this many (default 100, at most 1000)")
    add_json(p)
    p.set_defaults(handler=cmd_sessions)

    p = sub.add_parser("show", help="show a session's history, replayed from the store",
                       description="Replay a session's recorded events. Works with the "
                       "farm stopped (reads the store read-only).")
    add_home(p)
    p.add_argument("session", help="the session id (see 'corral sessions')")
    add_json(p)
    p.set_defaults(handler=cmd_show)

    p = sub.add_parser("terminate", help="end a session: abort its turn, refuse new ones",
                       description="Terminate a session: its running turn is aborted (tools "
                       "cancelled) and it accepts no further input, also after restarts. "
                       "Its history stays ('corral show'); 'corral delete' removes it.")
    add_home(p)
    p.add_argument("session", help="the session id (see 'corral sessions')")
    add_json(p)
    p.set_defaults(handler=cmd_terminate)

    p = sub.add_parser("delete", help="remove a session and its history from the store",
                       description="Delete a stored session (terminating it first if it "
                       "runs). Asks for confirmation at a terminal; --yes skips that (needed "
                       "without a terminal). Files it made in its workspace stay.")
    add_home(p)
    p.add_argument("session", help="the session id (see 'corral sessions')")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    add_json(p)
    p.set_defaults(handler=cmd_delete)


def parse_since(text: str, now: float) -> float:
    """``--since``: ``90s``/``30m``/``2h``/``7d``/``1w`` ago, or an ISO date/time (local)."""
    m = _DURATION.fullmatch(text.strip())
    if m:
        return now - float(m.group(1)) * _UNIT_S[m.group(2)]
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        raise ValueError(f"--since {text!r}: give a duration (90s, 30m, 2h, 7d) or a date "
                         "(2026-12-01 or 2026-12-01T10:00)") from None


@contextlib.contextmanager
def read_only_store(home: Path, *, farm_running: bool) -> Iterator[sqlite3.Connection]:
    from supervisor.farm.layout import FarmPaths
    from supervisor.store.url import redact

    url = _store_url(home)
    if url is not None:  # callers read PostgreSQL through pgsessions, not here
        raise StoreUnreadable(f"this farm's sessions are in PostgreSQL ({redact(url)}), "
                              "not in a SQLite file")
    db = FarmPaths.of(home).db
    if not db.exists():
        raise NoStore(f"no store at {db} yet: no session was ever created in this "
                              "home; start one with: corral run --workspace DIR \"PROMPT\"")
    modes = ["mode=ro"] if farm_running else ["mode=ro", "immutable=1"]
    last: sqlite3.Error | None = None
    for mode in modes:
        try:
            conn = sqlite3.connect(f"file:{quote(str(db))}?{mode}", uri=True, timeout=5.0)
            conn.execute("SELECT count(*) FROM sessions").fetchone()
        except sqlite3.Error as exc:
            last = exc
            continue
        try:
            yield conn
        finally:
            conn.close()
        return
    raise StoreUnreadable(f"cannot read the store {db}: {last}")


def _store_url(home: Path) -> str | None:
    """The farm's ``[store] url``; a corral.toml that does not load is ``StoreUnreadable``
    (its message names the key): where the sessions are is unknown, so "no sessions"
    would be a guess (it once was, with exit 0, for a mistyped PostgreSQL URL)."""
    from supervisor import config as config_mod

    try:
        return config_mod.load(home).store_url
    except config_mod.ConfigError as exc:
        raise StoreUnreadable(f"cannot tell where the sessions are: {exc}") from None


def _default_route(home: Path) -> str:
    from supervisor import config as config_mod

    try:
        return config_mod.load(home).default_route
    except config_mod.ConfigError:
        return "main"


def _summary(conn: sqlite3.Connection, row: tuple[Any, ...], farm_running: bool,
             default_route: str) -> dict[str, Any]:
    from supervisor.store.schema import key_range

    sid = int(row[0])
    state_row = conn.execute("SELECT updated_at, state FROM checkpoint_state WHERE sid = ?",
                             (sid,)).fetchone()
    turns, last_turn_at = conn.execute(
        "SELECT count(*), max(coalesce(ended_at, started_at)) FROM executions WHERE sid = ?",
        (sid,)).fetchone()
    last = conn.execute("SELECT outcome, reason FROM executions WHERE sid = ? "
                        "ORDER BY id DESC LIMIT 1", (sid,)).fetchone()
    lo, hi = key_range(sid)
    event = conn.execute("SELECT created_at FROM events WHERE k BETWEEN ? AND ? "
                         "ORDER BY k DESC LIMIT 1", (lo, hi)).fetchone()
    return summarize(row, state_row, turns, last_turn_at, last, event[0] if event else None,
                     running=farm_running, default_route=default_route)


def list_sessions(home: Path, *, farm_running: bool) -> tuple[list[dict[str, Any]], bool]:
    """Every session's summary, most recently active first; True if cut at MAX_SCANNED."""
    from supervisor.store import reader

    default_route = _default_route(home)
    url = _store_url(home)
    if url is not None:  # the shared store: every supervisor's sessions, with owners
        from supervisor.cli.pgsessions import list_pg_sessions

        out, cut = list_pg_sessions(url, MAX_SCANNED, default_route)
        out.sort(key=lambda s: (s["last_active_at"], s["session_id"]), reverse=True)
        return out, cut
    with read_only_store(home, farm_running=farm_running) as conn:
        conn.execute("BEGIN")
        rows = conn.execute(f"SELECT {reader.SESSION_COLUMNS} FROM sessions ORDER BY sid "
                            "DESC LIMIT ?", (MAX_SCANNED + 1,)).fetchall()
        out = [_summary(conn, row, farm_running, default_route)
               for row in rows[:MAX_SCANNED]]
        conn.execute("COMMIT")
    out.sort(key=lambda s: (s["last_active_at"], s["session_id"]), reverse=True)
    return out, len(rows) > MAX_SCANNED


def _ago(t: float, now: float) -> str:
    s = max(0.0, now - t)
    if s < 60:
        return f"{s:.0f}s ago"
    if s < 3600:
        return f"{s / 60:.0f}m ago"
    if s < 86_400:
        return f"{s / 3600:.0f}h ago"
    return time.strftime("%Y-%m-%d", time.localtime(t))


def cmd_sessions(ns: Namespace) -> int:
    from supervisor.farm.root import running_farm

    now = time.time()
    try:
        since = parse_since(ns.since, now) if ns.since else None
    except ValueError as exc:
        return say_error(ns, "usage", str(exc), EXIT_USAGE)
    if not 1 <= ns.limit <= 1000:
        return say_error(ns, "usage", "--limit must be between 1 and 1000", EXIT_USAGE)
    farm = running_farm(ns.home) is not None
    try:
        sessions, cut = list_sessions(ns.home, farm_running=farm)
    except NoStore:
        sessions, cut = [], False
    except StoreUnreadable as exc:
        return say_error(ns, "unavailable", str(exc), EXIT_FAILED)
    if ns.state:
        sessions = [s for s in sessions if s["state"] in ns.state]
    if since is not None:
        sessions = [s for s in sessions if s["last_active_at"] >= since]
    shown = sessions[: ns.limit]
    if ns.json:
        print_json({"sessions": shown, "farm_running": farm, "more": len(sessions) > ns.limit
                    or cut})
        return EXIT_OK
    if not shown:
        print("no sessions" + (" match" if ns.state or since else "") +
              ("" if farm else f" (no farm running at {ns.home})"))
        return EXIT_OK
    shared = _store_url(ns.home) is not None  # PostgreSQL: show each session's owner
    owner_head = f"{'OWNER':<24} " if shared else ""
    print(f"{'SESSION':<26} {'STATE':<20} {'TURNS':>5}  {'CREATED':<16} {'LAST ACTIVE':<11} "
          f"{owner_head}{'ROUTE':<14} WORKSPACE")
    for s in shown:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(s["created_at"]))
        owner = f"{clean(str((s['owner'] or {}).get('id') or '-'))[:24]:<24} " if shared else ""
        print(f"{clean(s['session_id']):<26} {s['state']:<20} {s['turns']:>5}  {created:<16} "
              f"{_ago(s['last_active_at'], now):<11} {owner}"
              f"{clean(str(s['route'] or '-')):<14} {clean(str(s['workspace'] or '-'))}")
    if len(sessions) > len(shown) or cut:
        print("(more sessions: raise --limit, or filter with --state / --since)")
    if shared:
        print("(read from the shared PostgreSQL store; OWNER: the supervisor holding the "
              "session's live lease)")
    elif not farm:
        print(f"(no farm running at {ns.home}: read from its store)")
    return EXIT_OK


def session_pages(home: Path, session_id: str, *, farm_running: bool
                  ) -> Iterator[list[dict[str, Any]]]:
    """A session's recorded events, page by page (bounded memory), read-only, in
    order; raises ``LookupError`` when there is no such session."""
    from supervisor.facade import event_to_wire
    from supervisor.store import reader

    with read_only_store(home, farm_running=farm_running) as conn:
        if reader.session_row(conn, session_id) is None:
            raise LookupError(session_id)
        after = 0
        while True:
            page = reader.events_page(conn, session_id, after, reader.MAX_PAGE_EVENTS)
            yield [event_to_wire(e) for e in page.items]
            if page.next_cursor is None:
                return
            after = int(page.next_cursor)


def session_exists(home: Path, session_id: str) -> bool:
    from supervisor.farm.root import running_farm
    from supervisor.store import reader

    url = _store_url(home)
    if url is not None:  # PostgreSQL: ask it (read-only), farm or not
        from supervisor.cli.pgsessions import pg_pages

        with contextlib.closing(pg_pages(url, session_id, page_size=1)) as pages:
            try:
                next(pages)
            except LookupError:
                return False
        return True

    try:
        with read_only_store(home, farm_running=running_farm(home) is not None) as conn:
            return reader.session_row(conn, session_id) is not None
    except NoStore:
        return False


def farm_pages(home: Path, session_id: str) -> Iterator[list[dict[str, Any]]]:
    """A session's recorded events asked of the running farm (a PostgreSQL store, which
    this process does not open), a page per call; ``LookupError`` if there is none."""
    from supervisor.cli.reach import supervisor_call
    from supervisor.client import SupervisorError

    after = 0
    while True:
        try:
            page = asyncio.run(supervisor_call(home, "history", session_id=session_id,
                                               after_sequence=after, limit=5000))
        except SupervisorError as exc:
            if exc.kind == "unknown_session":
                raise LookupError(session_id) from None
            raise StoreUnreadable(f"the farm could not answer: {exc}") from None
        yield list(page["events"])
        if page.get("next") is None or not page["events"]:
            return
        after = int(page["events"][-1]["sequence"])


def cmd_show(ns: Namespace) -> int:
    from supervisor import config as config_mod
    from supervisor.farm.root import running_farm

    farm = running_farm(ns.home) is not None
    try:
        on_pg = config_mod.load(ns.home).store_url is not None
    except config_mod.ConfigError:
        on_pg = False
    if on_pg:  # the running farm answers; without one, PostgreSQL itself
        from supervisor.cli.pgsessions import pg_pages

        url = _store_url(ns.home)
        pages = farm_pages(ns.home, ns.session) if farm or url is None else \
            pg_pages(url, ns.session)
    else:
        pages = session_pages(ns.home, ns.session, farm_running=farm)
    try:
        first = next(pages)
    except (LookupError, NoStore):
        return say_error(ns, "unknown_session", f"no session {ns.session!r} in {ns.home}; "
                         "list them with: corral sessions", EXIT_FAILED)
    except StoreUnreadable as exc:
        return say_error(ns, "unavailable", str(exc), EXIT_FAILED)
    renderer = Renderer(sys.stdout)
    out = sys.stdout
    if ns.json:  # one document, written as it is read ({"events": [...], "next": null})
        out.write('{"events": [')
    sep = ""
    for page in itertools.chain([first], pages):
        for event in page:
            if ns.json:
                out.write(sep + json.dumps(event, sort_keys=True, default=str))
                sep = ", "
            else:
                renderer.render(event)
    if ns.json:
        out.write('], "next": null}\n')
    out.flush()
    return EXIT_OK


# -- terminate / delete ---------------------------------------------------------


async def _terminate(home: Path, session_id: str, wait_s: float = 30.0) -> str:
    """Shut the session down through the running farm; wait until it is closed."""
    from supervisor.cli.reach import live_endpoint
    from supervisor.farm.layout import FarmPaths

    return await _terminate_at(await live_endpoint(home), session_id, wait_s,
                               FarmPaths.of(home).logs / "supervisor.log")


async def _terminate_at(endpoint: str, session_id: str, wait_s: float, log: Any) -> str:
    """Shut the session down through the supervisor at ``endpoint``; wait until closed."""
    from supervisor.client import SupervisorClient, SupervisorError

    async with SupervisorClient(endpoint) as sv:
        described = await sv.describe(session_id)
        if described.get("status") == "closed":
            return "already terminated"
        try:
            await sv.submit(session_id, {"type": "shutdown"})
        except SupervisorError as exc:
            if "shut down" in exc.message:
                return "already terminated"
            raise
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                described = await sv.describe(session_id)
            except SupervisorError as exc:
                if "shut down" in exc.message:
                    return "terminated"
                raise
            if described.get("status") == "closed":
                return "terminated"
            await asyncio.sleep(0.05)
    raise TimeoutError(f"session {session_id} did not close within {wait_s:.0f}s; see "
                       f"{log}")


async def _through_owner(store: Any, session_id: str) -> str | None:
    """No farm here, a shared (PostgreSQL) store: a session a live supervisor runs
    (anywhere) is terminated through it, never behind its back (it would go on running
    the session, and a delete would pull its rows from under it). The outcome, or None
    when no live supervisor holds the session."""
    from supervisor.client import SupervisorError
    from supervisor.store import SessionId

    locate = getattr(store, "locate", None)
    found = await locate(SessionId(session_id)) if locate is not None else None
    if found is None:
        return None
    owner, address, _ = found
    try:
        return await _terminate_at(address, session_id, 30.0, f"supervisor {owner}'s log")
    except SupervisorError as exc:
        raise OSError(f"session {session_id} is run by supervisor {owner} at {address} (a "
                      f"live lease), which did not terminate it: {exc.message}; run this "
                      "on a host of that farm, or wait for the lease to lapse") from None


async def _close_in_store(home: Path, session_id: str) -> str:
    """No farm: mark the session closed in the store itself (a turn left running is
    then never resumed)."""
    from supervisor.store import SessionId
    from supervisor.store.opening import open_for_home

    store = await open_for_home(home)  # SQLite, or [store] url
    try:
        record = await store.get_session(SessionId(session_id))
        if record is None:
            raise LookupError(session_id)
        if record.status != "active":
            return "already terminated"
        outcome = await _through_owner(store, session_id)
        if outcome is not None:
            return outcome
        await store.set_status(SessionId(session_id), "closed")
        return "terminated"
    finally:
        await store.close()


def _session_call(ns: Namespace, what: str, coro_fn: Any) -> tuple[int, str | None]:
    from supervisor.client import SupervisorError

    try:
        return EXIT_OK, asyncio.run(coro_fn())
    except LookupError:
        return say_error(ns, "unknown_session", f"no session {ns.session!r} in {ns.home}; "
                         "list them with: corral sessions", EXIT_FAILED), None
    except SupervisorError as exc:
        return say_error(ns, exc.kind, f"{what}: {exc.message}", EXIT_FAILED), None
    except (TimeoutError, OSError) as exc:
        return say_error(ns, "failed", f"{what}: {exc}", EXIT_FAILED), None


def cmd_terminate(ns: Namespace) -> int:
    from supervisor.farm.layout import FarmPaths
    from supervisor.farm.root import running_farm

    try:
        shared = _store_url(ns.home) is not None
    except StoreUnreadable as exc:
        return say_error(ns, "unavailable", str(exc), EXIT_FAILED)
    if running_farm(ns.home) is not None:
        code, outcome = _session_call(ns, "terminate", lambda: _terminate(ns.home, ns.session))
    elif not shared and not FarmPaths.of(ns.home).db.exists():
        return say_error(ns, "unknown_session", f"no session {ns.session!r} in {ns.home}",
                         EXIT_FAILED)
    else:
        code, outcome = _session_call(ns, "terminate",
                                      lambda: _close_in_store(ns.home, ns.session))
    if code != EXIT_OK:
        return code
    if ns.json:
        print_json({"ok": True, "session_id": ns.session, "outcome": outcome})
    else:
        print(f"session {ns.session} {outcome}; its history stays (corral show "
              f"{ns.session}); remove it with: corral delete {ns.session}")
    return EXIT_OK


async def _delete_via_farm(home: Path, session_id: str) -> str:
    from supervisor.cli.reach import live_endpoint
    from supervisor.client import SupervisorClient

    await _terminate(home, session_id)
    async with SupervisorClient(await live_endpoint(home)) as sv:
        await sv.call("delete_session", session_id=session_id)
    return "deleted"


async def _delete_in_store(home: Path, session_id: str) -> str:
    from supervisor.store import SessionId
    from supervisor.store.opening import open_for_home

    store = await open_for_home(home)  # SQLite, or [store] url
    try:
        record = await store.get_session(SessionId(session_id))
        if record is None:
            raise LookupError(session_id)
        if record.status == "active":
            await _through_owner(store, session_id)  # closed there, its lease released
        await store.delete_session(SessionId(session_id))
        return "deleted"
    finally:
        await store.close()


def _confirm(ns: Namespace) -> bool | None:
    """True to go on; False refused; None: cannot ask (no terminal)."""
    if ns.yes:
        return True
    if not sys.stdin.isatty():
        return None
    try:
        answer = input(f"delete session {ns.session} and its whole history from {ns.home}? "
                       "This cannot be undone. [y/N] ")
    except EOFError:
        return False
    return answer.strip().lower() in ("y", "yes")


def cmd_delete(ns: Namespace) -> int:
    from supervisor.farm.root import running_farm

    farm = running_farm(ns.home) is not None
    try:
        known = session_exists(ns.home, ns.session)
    except StoreUnreadable as exc:
        return say_error(ns, "unavailable", str(exc), EXIT_FAILED)
    if not known:
        return say_error(ns, "unknown_session", f"no session {ns.session!r} in {ns.home}; "
                         "list them with: corral sessions", EXIT_FAILED)
    confirmed = _confirm(ns)
    if confirmed is None:
        return say_error(ns, "usage", "deleting needs a confirmation and there is no "
                         f"terminal to ask; pass --yes: corral delete {ns.session} --yes",
                         EXIT_USAGE)
    if not confirmed:
        print("not deleted", file=sys.stderr)
        return EXIT_FAILED
    if farm:
        code, _ = _session_call(ns, "delete", lambda: _delete_via_farm(ns.home, ns.session))
    else:
        code, _ = _session_call(ns, "delete", lambda: _delete_in_store(ns.home, ns.session))
    if code != EXIT_OK:
        return code
    if ns.json:
        print_json({"ok": True, "session_id": ns.session, "outcome": "deleted"})
    else:
        print(f"session {ns.session} deleted (its workspace files stay)")
    return EXIT_OK
