"""Session leases and fencing on PostgreSQL: which supervisor owns which session.

A lease row per session (``leases``: sid, owner, epoch, expires_at). The **epoch** is
the fencing token: it grows by one every time the lease is acquired (a change of
owner, or the same owner coming back after it lapsed). Expiry is on the database
server's clock (``clock_timestamp()``): the one clock every supervisor on every host
shares, so no host's clock skew moves a deadline.

Invariants:
- ``acquire`` takes a lease only when it is free, expired or already under the same
  owner id, and always with a new epoch (``epoch + 1``), in one statement (the row
  lock makes two acquirers serialize: one wins, the other sees a live lease).
- ``check`` is the first statement of every write a supervisor makes for a session in
  lease mode. It holds the lease row ``FOR SHARE`` until the write's transaction ends,
  so a takeover (an UPDATE of that row) waits for the write to commit or roll back:
  a write is either committed before the new owner's epoch exists, or refused. It
  refuses (``LeaseLost``) unless owner, epoch AND expiry match: a supervisor paused
  past its lease has every later write refused even before anyone took over.
- ``renew`` extends only live leases of this owner on the sessions its process holds
  (never one it released or gave up); a lapsed one must be acquired again
  (new epoch), so a paused supervisor can never silently continue.
- ``reacquire`` takes a lapsed lease back only if the row still names this owner AND
  the epoch it held: every acquisition by anyone bumps the epoch, so an unchanged epoch
  proves nobody owned the session in between and this owner's memory of it is still
  the truth (after a PostgreSQL outage longer than the lease). Anything else: lost.
"""

from __future__ import annotations

from typing import Any

from broker import plants
from supervisor.store.errors import LeaseLost
from supervisor.store.pg.reader import all_rows, one
from supervisor.store.pg.schema import Conn

NOW = "extract(epoch from clock_timestamp())"


async def check(conn: Conn, sid: int, session_id: str, owner: str, epoch: int) -> None:
    row = await one(conn, f"SELECT owner, epoch, expires_at > {NOW} FROM leases"
                          " WHERE sid = %s FOR SHARE", (sid,))
    if row is None or row[0] != owner or row[1] != epoch or not row[2]:
        found = "no lease" if row is None else (
            f"owner {row[0]!r} epoch {row[1]}{'' if row[2] else ' (expired)'}")
        raise LeaseLost(f"session {session_id!r}: this supervisor ({owner}) held epoch "
                        f"{epoch}; the lease now says {found}; the write was refused")


def _bump() -> str:
    """The new epoch of an acquisition (``acquire`` and ``claim``): always one more.
    The ``epoch_reused`` chaos plant keeps a new owner on the old token."""
    if plants.on("epoch_reused"):
        return "leases.epoch + (leases.owner IS NOT DISTINCT FROM excluded.owner)::int"
    return "leases.epoch + 1"


async def acquire(conn: Conn, sid: int, owner: str, lease_s: float) -> int | None:
    """Take the lease of session ``sid`` if it is free, expired, or recorded under this
    same owner id (a restarted supervisor taking its sessions back at once: the new
    epoch fences whatever the previous process of that id still had in flight). Its new
    epoch, or None (another supervisor holds it)."""
    row = await one(
        conn, f"INSERT INTO leases (sid, owner, epoch, expires_at) VALUES (%s, %s, 1, {NOW} + %s)"
        f" ON CONFLICT (sid) DO UPDATE SET owner = excluded.owner, epoch = {_bump()},"
        " expires_at = excluded.expires_at WHERE leases.owner IS NULL"
        f" OR leases.expires_at <= {NOW} OR leases.owner = excluded.owner RETURNING epoch",
        (sid, owner, lease_s))
    return int(row[0]) if row is not None else None


async def renew(conn: Conn, owner: str, lease_s: float, sids: list[int]) -> dict[int, int]:
    """Extend the live leases of ``owner`` on ``sids`` (the sessions its process holds:
    never one it gave up or released, which would otherwise stay its load and out of
    other supervisors' reach forever): {sid: epoch} of those still held."""
    rows = await all_rows(
        conn, f"UPDATE leases SET expires_at = {NOW} + %s WHERE owner = %s"
        f" AND sid = ANY(%s::bigint[]) AND expires_at > {NOW} RETURNING sid, epoch",
        (lease_s, owner, sids))
    return {int(r[0]): int(r[1]) for r in rows}


async def reacquire(conn: Conn, owner: str, lease_s: float,
                    held: dict[int, int]) -> dict[int, int]:
    """Take back, under a new epoch, the lapsed leases of ``held`` ({sid: epoch held})
    whose row still says this owner and that epoch (nobody acquired them since):
    {sid: new epoch} of those taken back. One statement; the row lock serializes it
    with another supervisor's ``acquire``, so one of the two wins."""
    if not held:
        return {}
    sids, epochs = list(held), [held[s] for s in held]
    rows = await all_rows(
        conn, f"UPDATE leases l SET epoch = l.epoch + 1, expires_at = {NOW} + %s"
        " FROM unnest(%s::bigint[], %s::bigint[]) AS h(sid, epoch)"
        " WHERE l.sid = h.sid AND l.epoch = h.epoch AND l.owner = %s"
        " RETURNING l.sid, l.epoch", (lease_s, sids, epochs, owner))
    return {int(r[0]): int(r[1]) for r in rows}


async def release(conn: Conn, sid: int, owner: str, epoch: int) -> None:
    """Give the lease up at once (the next acquirer bumps the epoch)."""
    await conn.execute("UPDATE leases SET owner = NULL, expires_at = 0 WHERE sid = %s"
                       " AND owner = %s AND epoch = %s", (sid, owner, epoch))


async def sign_off(conn: Conn, owner: str, lease_s: float, held: list[tuple[int, int]]
                   ) -> int:
    """A supervisor stopping cleanly: give up every lease in ``held`` (sid, epoch) at
    once, and date its heartbeat a lease back, so other supervisors claim its sessions
    at their next round instead of when the leases lapse, and placement no longer
    sends new sessions to it (status still lists it, silent). Returns how many
    leases were released (a row another owner took meanwhile is left alone)."""
    released = 0
    if held:
        cur = await conn.execute(
            "UPDATE leases l SET owner = NULL, expires_at = 0"
            " FROM unnest(%s::bigint[], %s::bigint[]) AS h(sid, epoch)"
            " WHERE l.sid = h.sid AND l.epoch = h.epoch AND l.owner = %s",
            ([n for n, _ in held], [e for _, e in held], owner))
        released = max(0, cur.rowcount)
    await conn.execute(f"UPDATE supervisors SET heartbeat_at = {NOW} - %s"
                       " WHERE supervisor_id = %s".encode(), (lease_s, owner))
    return released


async def next_lapse(conn: Conn, owner: str) -> float | None:
    """Seconds until the soonest live lease of another owner lapses (None: there is
    none): when a dead supervisor's sessions become claimable, at the earliest."""
    row = await one(conn, f"SELECT min(expires_at) - {NOW} FROM leases WHERE owner <> %s"
                          f" AND expires_at > {NOW}", (owner,))
    return None if row is None or row[0] is None else max(0.0, float(row[0]))


async def claim(conn: Conn, owner: str, lease_s: float, limit: int,
                own: bool, exclude: list[int] | None = None) -> list[tuple[int, str, int]]:
    """Acquire up to ``limit`` active sessions nobody holds a live lease on (with
    ``own``, also those leased to this owner id: a restart taking its sessions back),
    oldest first, in ONE statement (a takeover claims many at once): (sid, session_id,
    new epoch) of those taken. The rules of ``acquire``: free, expired or this owner's,
    always under ``epoch + 1``; a row another claimer took meanwhile is skipped; the
    sids in ``exclude`` (still held in this supervisor's memory) are never claimed."""
    rows = await all_rows(
        conn, "WITH c AS (SELECT s.sid FROM sessions s LEFT JOIN leases l ON l.sid = s.sid"
        " WHERE s.status = 'active' AND (l.sid IS NULL OR l.owner IS NULL"
        f" OR l.expires_at <= {NOW} OR l.owner = %s)"
        " AND NOT (s.sid = ANY(%s::bigint[])) ORDER BY s.sid LIMIT %s),"
        " got AS (INSERT INTO leases (sid, owner, epoch, expires_at)"
        f" SELECT sid, %s, 1, {NOW} + %s FROM c"
        f" ON CONFLICT (sid) DO UPDATE SET owner = excluded.owner, epoch = {_bump()},"
        " expires_at = excluded.expires_at WHERE leases.owner IS NULL"
        f" OR leases.expires_at <= {NOW} OR leases.owner = excluded.owner"
        " RETURNING sid, epoch)"
        " SELECT got.sid, s.session_id, got.epoch FROM got JOIN sessions s ON s.sid = got.sid"
        " ORDER BY got.sid", (owner if own else None, exclude or [], limit, owner, lease_s))
    return [(int(r[0]), str(r[1]), int(r[2])) for r in rows]


async def owners(conn: Conn) -> list[tuple[str, int, float]]:
    """(owner, sessions held, seconds since the oldest lease was renewed...) per owner:
    each live owner with its session count and the smallest time left on its leases."""
    rows = await all_rows(
        conn, f"SELECT owner, count(*), min(expires_at - {NOW}) FROM leases"
        f" WHERE owner IS NOT NULL AND expires_at > {NOW} GROUP BY owner ORDER BY owner")
    return [(str(r[0]), int(r[1]), float(r[2])) for r in rows]


async def roster(conn: Conn, window_s: float) -> list[tuple[Any, ...]]:
    """Every supervisor heard within ``window_s`` or holding live leases: (id, address,
    host, pid, seconds since its heartbeat, sessions under its live leases, seconds left
    on its soonest-expiring lease or None), by id. A supervisor holding no session is
    listed too, and one that went silent stays listed (its heartbeat age says so)."""
    return await all_rows(
        conn, "SELECT coalesce(v.supervisor_id, o.owner), v.address, v.host, v.pid,"
        f" {NOW} - v.heartbeat_at, coalesce(o.n, 0), o.left_s FROM supervisors v"
        f" FULL JOIN (SELECT owner, count(*) AS n, min(expires_at - {NOW}) AS left_s"
        f" FROM leases WHERE owner IS NOT NULL AND expires_at > {NOW} GROUP BY owner) o"
        " ON o.owner = v.supervisor_id"
        f" WHERE o.owner IS NOT NULL OR v.heartbeat_at > {NOW} - %s ORDER BY 1",
        (window_s,))


async def holder(conn: Conn, owner: str) -> tuple[str, int, str, float] | None:
    """(host, pid, address, seconds since its heartbeat) of the process that last
    advertised ``owner``; None: never advertised."""
    row = await one(conn, f"SELECT host, pid, address, {NOW} - heartbeat_at FROM supervisors"
                          " WHERE supervisor_id = %s", (owner,))
    return None if row is None else (str(row[0]), int(row[1]), str(row[2]), float(row[3]))


async def advertise(conn: Conn, owner: str, address: str, host: str, pid: int) -> None:
    """Record (or update, after a restart) where ``owner`` serves clients."""
    await conn.execute((
        "INSERT INTO supervisors (supervisor_id, address, host, pid, started_at, heartbeat_at)"
        f" VALUES (%s, %s, %s, %s, {NOW}, {NOW}) ON CONFLICT (supervisor_id) DO UPDATE"
        " SET address = EXCLUDED.address, host = EXCLUDED.host, pid = EXCLUDED.pid,"
        " started_at = EXCLUDED.started_at, heartbeat_at = EXCLUDED.heartbeat_at").encode(),
        (owner, address, host, pid))


async def locate(conn: Conn, session_id: str) -> tuple[str, str, str | None] | None:
    """(owner, its client address, the session's tenant) of an active session under a
    live lease whose owner advertised an address; None otherwise."""
    row = await one(
        conn, "SELECT l.owner, v.address, s.tenant FROM sessions s"
        " JOIN leases l ON l.sid = s.sid JOIN supervisors v ON v.supervisor_id = l.owner"
        f" WHERE s.session_id = %s AND s.status = 'active' AND l.expires_at > {NOW}",
        (session_id,))
    if row is None:
        return None
    return str(row[0]), str(row[1]), None if row[2] is None else str(row[2])


async def beat(conn: Conn, owner: str) -> None:
    """This supervisor is alive (placement counts only supervisors heard within a lease)."""
    await conn.execute(f"UPDATE supervisors SET heartbeat_at = {NOW}"
                       " WHERE supervisor_id = %s".encode(), (owner,))


async def loads(conn: Conn, lease_s: float) -> list[tuple[str, str, int]]:
    """(supervisor id, address, sessions under its live leases) of every supervisor
    heard within ``lease_s``, least loaded first (ties by id)."""
    rows = await all_rows(
        conn, "SELECT v.supervisor_id, v.address, count(l.sid) FROM supervisors v"
        f" LEFT JOIN leases l ON l.owner = v.supervisor_id AND l.expires_at > {NOW}"
        f" WHERE v.heartbeat_at > {NOW} - %s GROUP BY v.supervisor_id, v.address"
        " ORDER BY count(l.sid), v.supervisor_id", (lease_s,))
    return [(str(r[0]), str(r[1]), int(r[2])) for r in rows]
