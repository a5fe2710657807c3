"""A step's write on PostgreSQL in ONE statement (one round trip), with its checks and
its fence in that statement; the full rules of ``pg/writer.apply_step`` otherwise.

Why: the writer runs a group's statements one round trip at a time on one connection,
and a step used to cost about seven (savepoint, checks, events, batch, state,
execution, release; two more in lease mode). ``StepOp.send`` sends one statement whose
CTEs read what the checks need (the session, its last event and batch, the stored
state's counters; in lease mode the lease row ``FOR SHARE``), decide whether the step
is the ordinary next step (``ok``), and only then insert the events, the batch, the
state and the execution. The ordinary next step: its events start right after the last
stored one, its batch right after the last batch, its state counters lie past both
and not behind the stored state, no rewrite, and (lease mode) the lease is this
owner's, at this epoch, unexpired.

Invariants:
- When ``ok`` is false nothing is written (every insert selects FROM ``ok``); the
  caller then runs the step the slow way (``StepOp.__call__``: ``leases.check`` and
  ``writer.apply_step`` under a savepoint), which raises the right error
  (``LeaseLost``, ``SequenceConflict``, ``SessionNotFound``) or does the idempotent
  re-write. So the one statement never changes an answer, only the round trips.
- ``writer.apply_group`` sends the statements of consecutive steps of DISTINCT
  sessions in one pipeline (one round trip for all of them): their rows and lease
  rows are disjoint, so their order inside that run does not matter; a second step of
  a session starts a new run, so it sees the first one's rows.
- Fencing is the same rule as ``leases.check``: the lease row is read ``FOR SHARE`` in
  the statement (a takeover's UPDATE of the row waits for this transaction; under
  READ COMMITTED the locked row is re-read at its newest version), and owner, epoch
  AND expiry must match, else nothing of the step is written.
- A statement error (a concurrent writer's key, a value PostgreSQL refuses) aborts the
  group's transaction: ``writer.apply_group`` then runs the whole group again the slow
  way, a savepoint per operation.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from supervisor.store.pg import leases
from supervisor.store.pg.schema import Conn
from supervisor.store.schema import KEY_LIMIT
from supervisor.store.writer import PreparedStep, upsert_execution

NOW = leases.NOW
# Steps of this process written in one statement, and those that went the slow way
# (diagnostics for the benchmark and the tests; never a decision).
COUNTS: Counter[str] = Counter()

_HEAD = (
    "h AS (SELECT s.sid,"
    " COALESCE((SELECT e.sequence FROM events e WHERE e.sid = s.sid"
    " ORDER BY e.sequence DESC LIMIT 1), 0) AS le,"
    " COALESCE((SELECT b.sequence FROM transcript_batches b WHERE b.sid = s.sid"
    " ORDER BY b.sequence DESC LIMIT 1), 0) AS lb,"
    " c.next_event_sequence AS ne, c.next_batch_sequence AS nb"
    " FROM sessions s LEFT JOIN checkpoint_state c ON c.sid = s.sid"
    " WHERE s.session_id = %(session)s::text)"
)
_FENCE = (
    f", f AS (SELECT owner = %(owner)s::text AND epoch = %(epoch)s::bigint"
    f" AND expires_at > {NOW} AS live FROM leases WHERE sid = (SELECT sid FROM h) FOR SHARE)"
)
_EVENTS = (
    ", ev AS (INSERT INTO events (sid, sequence, type, submission_id, created_at, payload)"
    " SELECT ok.sid, u.* FROM ok, unnest(%(e_seq)s::bigint[], %(e_type)s::text[],"
    " %(e_sub)s::text[], %(e_at)s::float8[], %(e_payload)s::text[]) u RETURNING 1)"
)
# In lease mode each event records the lease it was written under (schema v3), as
# ``writer.apply_step`` does on the slow path.
_EVENTS_LEASED = (
    ", ev AS (INSERT INTO events (sid, sequence, type, submission_id, created_at, payload,"
    " lease_owner, lease_epoch) SELECT ok.sid, u.*, %(owner)s::text, %(epoch)s::bigint"
    " FROM ok, unnest(%(e_seq)s::bigint[], %(e_type)s::text[], %(e_sub)s::text[],"
    " %(e_at)s::float8[], %(e_payload)s::text[]) u RETURNING 1)"
)
_BATCH = (
    ", bt AS (INSERT INTO transcript_batches (sid, sequence, epoch, created_at, items)"
    " SELECT ok.sid, %(b_seq)s::bigint, %(b_epoch)s::bigint, %(b_at)s::float8,"
    " %(b_items)s::text FROM ok RETURNING 1)"
)
_STATE = (
    ", st AS (INSERT INTO checkpoint_state (sid, updated_at, next_event_sequence,"
    " next_batch_sequence, state) SELECT ok.sid, %(now)s::float8, %(s_ne)s::bigint,"
    " %(s_nb)s::bigint, %(s_text)s::text FROM ok"
    " ON CONFLICT (sid) DO UPDATE SET updated_at = excluded.updated_at,"
    " next_event_sequence = excluded.next_event_sequence,"
    " next_batch_sequence = excluded.next_batch_sequence, state = excluded.state"
    " WHERE checkpoint_state.next_event_sequence <= excluded.next_event_sequence"
    " AND checkpoint_state.next_batch_sequence <= excluded.next_batch_sequence RETURNING 1)"
)
_EXECUTION = ", x AS (" + upsert_execution(
    "SELECT ok.sid, %(x_turn)s::text, %(x_outcome)s::text, %(x_model)s::bigint,"
    " %(x_tools)s::bigint, %(x_failed)s::bigint, %(x_usage)s::text, %(x_start)s::float8,"
    " %(x_end)s::float8, %(x_elapsed)s::float8, %(x_tier)s::text, %(x_reason)s::text FROM ok"
) + " RETURNING 1)"
_QUERIES: dict[tuple[bool, ...], bytes] = {}


def _query(fenced: bool, events: bool, batch: bool, state: bool, execution: bool) -> bytes:
    """The statement for one shape of step (at most 32, each prepared by psycopg after
    a few uses: the text is the same for every step of that shape)."""
    shape = (fenced, events, batch, state, execution)
    found = _QUERIES.get(shape)
    if found is not None:
        return found
    conds = ["TRUE"]
    if fenced:
        conds.append("COALESCE((SELECT live FROM f), FALSE)")
    if events:
        conds.append("h.le = %(e_after)s::bigint")
    if batch:
        conds.append("h.lb = %(b_after)s::bigint")
    if state:
        le = "%(e_last)s::bigint" if events else "h.le"
        lb = "%(b_seq)s::bigint" if batch else "h.lb"
        conds.append(f"%(s_ne)s::bigint > {le} AND %(s_nb)s::bigint > {lb}"
                     " AND (h.ne IS NULL OR (%(s_ne)s::bigint >= h.ne"
                     " AND %(s_nb)s::bigint >= h.nb))")
    text = "WITH " + _HEAD + (_FENCE if fenced else "")
    text += f", ok AS (SELECT h.sid FROM h WHERE {' AND '.join(conds)})"
    if events:
        text += _EVENTS_LEASED if fenced else _EVENTS
    text += _BATCH if batch else ""
    text += (_STATE if state else "") + (_EXECUTION if execution else "")
    text += " SELECT count(*) FROM ok"
    query = text.encode()
    _QUERIES[shape] = query
    return query


def params(p: PreparedStep, fence: tuple[str, int] | None,
           now: float) -> dict[str, Any] | None:
    """The statement's parameters, or None when the step is not of the ordinary shape
    (a rewrite, a number out of range): the slow path handles it."""
    if p.rewrite is not None:
        return None
    numbers = [e[0] for e in p.events]
    if p.batch is not None:
        numbers += [p.batch[0], p.batch[1]]
    if p.state is not None:
        numbers += [p.state[0], p.state[1]]
    if any(not 0 <= n < KEY_LIMIT for n in numbers):
        return None
    out: dict[str, Any] = {"session": p.session_id, "now": now}
    if fence is not None:
        out["owner"], out["epoch"] = fence
    if p.events:
        out["e_after"] = p.events[0][0] - 1
        out["e_last"] = p.events[-1][0]
        out["e_seq"] = [e[0] for e in p.events]
        out["e_type"] = [e[1] for e in p.events]
        out["e_sub"] = [e[2] for e in p.events]
        out["e_at"] = [e[3] for e in p.events]
        out["e_payload"] = [e[4] for e in p.events]
    if p.batch is not None:
        out["b_seq"], out["b_epoch"], out["b_at"], out["b_items"] = p.batch
        out["b_after"] = p.batch[0] - 1
    if p.state is not None:
        out["s_ne"], out["s_nb"], out["s_text"] = p.state
    if p.execution is not None:
        x = p.execution
        (out["x_turn"], out["x_outcome"], out["x_model"], out["x_tools"], out["x_failed"],
         out["x_usage"], out["x_start"], out["x_end"], out["x_elapsed"], out["x_tier"],
         out["x_reason"]) = x
    return out


@dataclass(frozen=True, slots=True)
class StepOp:
    """One step of a group: ``send`` (one statement) first, ``__call__`` (the full
    rules, under the caller's savepoint) when that statement wrote nothing."""

    prepared: PreparedStep
    fence: tuple[str, int] | None  # (owner, epoch) in lease mode

    @property
    def key(self) -> str:
        """The session written: steps of distinct sessions are independent."""
        return self.prepared.session_id

    async def send(self, conn: Conn, now: float) -> Any | None:
        """Send the one statement (in pipeline mode: queue it). Its cursor, whose one row
        is 1 when the step is written and 0 when nothing was (not the ordinary next step,
        or the fence refused: run it the slow way for the exact answer); None when the
        step has no one-statement form."""
        p = self.prepared
        values = params(p, self.fence, now)
        if values is None:
            return None
        query = _query(self.fence is not None, bool(p.events), p.batch is not None,
                       p.state is not None, p.execution is not None)
        return await conn.execute(query, values)

    async def __call__(self, conn: Conn) -> None:
        from supervisor.store.pg.writer import apply_step, require_sid

        if self.fence is not None:
            sid = await require_sid(conn, self.prepared.session_id)
            await leases.check(conn, sid, self.prepared.session_id, *self.fence)
        await apply_step(conn, self.prepared, self.fence)
