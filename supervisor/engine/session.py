"""One session: its durable state, its in-memory context, commit-then-publish,
subscribers, and the driver that runs its work one item at a time.

A session is cheap while idle: a plain object (record, checkpoint state,
subscriber set, and its context only if short) and **no task**. A context
longer than ``EngineConfig.idle_context_items`` is dropped when the driver
ends and reloaded from the store (``Store.load``) when work starts again.
The driver task exists only while there is work (a turn, a hook run, a
compaction); it is created in the manager's TaskGroup by ``kick`` and ends
when the work queue is empty.

Invariants:
- Commit before visible: ``commit`` assigns the next event/batch sequences,
  awaits ``Store.commit`` of one ``StepWrite`` and only then publishes the
  events; a failed commit rolls the sequence counters back. A cancellation
  (interrupt) never cuts a commit in half: the step is finished, published,
  and only then is the cancellation re-raised, so memory and store agree.
- Everything ``commit`` stores is storable: items, rewrites and event
  payloads pass ``bounds.fit_items``/``fit_value`` (the store's bounds, valid
  UTF-8) before they are stored, kept in memory or published.
- ``commit`` calls are serialized by one lock per session, so parallel tool
  calls of a step enter the transcript in completion order.
- ``call_ids`` is exactly the set of ``call_id`` of the ``function_call`` items
  in ``context`` whenever the context is loaded: built with it, extended by
  each committed batch, rebuilt from each rewrite (compaction, a pre_model
  rewrite) and from each reload; cleared with the context on idle eviction.
  ``toolround`` renames a model's call_id found in it (a call_id is unique
  within the context the provider pairs outputs in).
- Every subscriber queue is bounded; an overflowing subscriber is dropped
  (``SubscriberDropped``), never the session and never another subscriber.
- The driver never raises: it is the catch-all boundary of a session's work
  (a bug in one session's turn fails that turn, not the manager).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from broker import plants  # chaos plant switches (broker/plants.py)
from broker.protocol import Failure, FailureKind
from sandbox_worker.api import ModelRoute, Usage, empty_usage, json_size
from supervisor import crashpoints
from supervisor.engine import bounds
from supervisor.engine import events as ev
from supervisor.engine.approvals import ApprovalPolicy, parse_policy
from supervisor.engine.calls import Broker
from supervisor.engine.config import EngineConfig, SessionSpec
from supervisor.engine.errors import BadOp, HookFailed, SubscriberDropped, TurnError
from supervisor.engine.hooks import HookEvent, HookRunner
from supervisor.engine.outage import PAUSABLE, Outage
from supervisor.store import SessionStore, StoreError
from supervisor.store.codec import Limits
from supervisor.store.records import (
    CheckpointState,
    ContextRewrite,
    EventRecord,
    ExecutionRecord,
    LoadedSession,
    SessionId,
    SessionRecord,
    StepWrite,
    SubmissionId,
    TranscriptBatch,
    TurnId,
)

log = logging.getLogger(__name__)

EventSpec = tuple[str, dict[str, Any], SubmissionId | None]


@dataclass(slots=True, eq=False)
class Subscriber:
    queue: asyncio.Queue[EventRecord]
    dropped: bool = False


@dataclass(slots=True)
class Work:
    """One unit of driver work: a turn, a compaction, a session_start run."""

    kind: str  # "turn" | "compact" | "session_start" | "resume" | "shutdown"
    source: str = ""  # session_start source
    submission_id: SubmissionId | None = None


class Host(Protocol):
    """What a session needs of the manager that owns it (``SessionManager``):
    the shared services, and the work it runs (``run_work``: turns and hook
    runs, so that this module never imports the turn driver)."""

    @property
    def config(self) -> EngineConfig: ...
    @property
    def store(self) -> SessionStore: ...
    @property
    def broker(self) -> Broker: ...
    @property
    def export_sinks(self) -> Sequence[Any]: ...
    def route(self, name: str) -> ModelRoute: ...
    async def observe_usage(self, route: str, usage: Usage) -> None: ...
    async def store_commit(self, step: StepWrite) -> None: ...
    async def load_session(self, sid: SessionId) -> LoadedSession | None: ...
    def replay_from(self, sid: SessionId, after_sequence: int) -> AsyncIterator[EventRecord]: ...
    def spawn(self, coro: Coroutine[Any, Any, None], *, name: str) -> asyncio.Task[None]: ...
    async def close_session(self, session: Session,
                            submission_id: SubmissionId | None) -> None: ...
    async def run_work(self, session: Session, work: Work) -> None: ...


class RunningTurn(Protocol):
    """What the session and the manager see of a running turn (``turn.Turn``)."""

    @property
    def turn_id(self) -> TurnId: ...
    @property
    def finishing(self) -> bool: ...
    force_compact: bool  # a compact op during the turn: before its next model step
    def interrupt(self) -> None: ...


@dataclass(slots=True)
class PendingApproval:
    """The open approval request's answer slot, and when it was requested.

    ``requested_at`` is the wall-clock time stored with its
    ``exec_approval_request`` event (the only clock that survives a restart);
    ``requested_mono`` is set too when this process made the request, and then
    wins (``elapsed_s``)."""

    approval_id: str
    turn_id: str
    future: asyncio.Future[str] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    # Resolved once the answer's verdicts are committed (or the turn ended without
    # them): the answer's submit returns only then, so an acknowledged answer is
    # never lost to a restart (a crash before it: the client's retry reaches the
    # resumed session, which still waits for it).
    applied: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    requested_at: float | None = None
    requested_mono: float | None = None

    def elapsed_s(self) -> float | None:
        """Seconds since the request (None: unknown). A wall clock stepped back
        counts as no time elapsed, never as negative."""
        if self.requested_mono is not None:
            return max(0.0, time.monotonic() - self.requested_mono)
        if self.requested_at is not None:
            return max(0.0, time.time() - self.requested_at)
        return None


class Session:
    def __init__(self, manager: Host, record: SessionRecord, state: CheckpointState,
                 context: list[dict[str, Any]], hooks: HookRunner) -> None:
        self.manager = manager
        self.record = record
        self.sid: SessionId = record.session_id
        self.spec = SessionSpec.from_config(record.config, session_id=record.session_id,
                                            parent_session_id=record.parent_session_id)
        self.policy: ApprovalPolicy = parse_policy(self.spec.approval)
        self.state = state
        self.context = context
        # A long context is dropped while the session is idle and reloaded from the
        # store when work starts (the store is the source of truth; see _drive).
        self.context_evicted = False
        self.context_len = len(context)
        self.call_ids: set[str] = call_ids_of(context)
        self.hooks = hooks
        self.subscribers: set[Subscriber] = set()
        self.work: collections.deque[Work] = collections.deque()
        self.driver: asyncio.Task[None] | None = None
        self.turn: RunningTurn | None = None
        self.turn_task: asyncio.Task[None] | None = None
        self.approval: PendingApproval | None = None
        self.pending_interrupt: str | None = None  # for a turn about to be resumed
        self.closed = record.status != "active"
        # Leases (several supervisors, docs/multihost.md): set when this supervisor lost
        # the session's lease; nothing more is published, the session leaves memory.
        self.fenced = False
        # Set while a step of this session waits for an unreachable store (outage.py).
        self.store_outage: Outage | None = None
        self._lock = asyncio.Lock()
        self._admit_lock = asyncio.Lock()
        self._last_published = state.next_event_sequence - 1
        self._delta_index = 0
        # A deep copy of the state as last committed (None: unknown, always commit)
        self._last_committed: dict[str, Any] | None = None

    @property
    def config(self) -> EngineConfig:
        return self.manager.config

    @property
    def store_limits(self) -> Limits:
        """The bounds the store enforces (``supervisor.store.codec.Limits``)."""
        limits = getattr(self.manager.store, "limits", None)
        return limits if isinstance(limits, Limits) else Limits()

    @property
    def route_name(self) -> str:
        return self.state.route or self.spec.route or self.config.default_route

    # ------------------------------------------------------------------ commit

    async def commit(
        self, events: Sequence[EventSpec] = (),
        *, items: list[dict[str, Any]] | None = None,
        rewrite: tuple[list[dict[str, Any]], list[str]] | None = None,
        execution: ExecutionRecord | None = None,
        mutate: Callable[[CheckpointState], None] | None = None,
    ) -> list[EventRecord]:
        """Commit one step (events, a transcript batch, a rewrite, the state).

        A step that would write only the state, when the state equals the one
        last committed, is not sent to the store: the row would be rewritten
        with the same bytes (one turn made one such step of 14 in the sessions
        benchmark)."""
        # Storable whatever the model or a hook produced: bounded, valid UTF-8.
        limits = self.store_limits
        events = [(t, bounds.fit_value(p, limits.max_payload_bytes), sub)
                  for t, p, sub in events]
        if items:
            items = bounds.fit_items(items, limits.max_item_bytes, limits.max_batch_bytes)
        if rewrite is not None:
            rewrite = (bounds.fit_items(rewrite[0], limits.max_item_bytes,
                                        limits.max_rewrite_bytes), rewrite[1])
        async with self._lock:
            st = self.state
            saved = (st.next_event_sequence, st.next_batch_sequence, st.context_epoch,
                     st.to_json())
            if mutate is not None:
                mutate(st)
            if (not events and not items and rewrite is None and execution is None
                    and self._last_committed is not None
                    and st.to_json() == self._last_committed):
                return []
            records = []
            for type_, payload, sub in events:
                records.append(ev.durable(self.sid, st.next_event_sequence, type_, payload, sub))
                st.next_event_sequence += 1
            rw = None
            if rewrite is not None:
                new_items, reasons = rewrite
                st.context_epoch += 1
                rw = ContextRewrite(st.context_epoch, new_items, reasons,
                                    at_batch=st.next_batch_sequence - 1)
            batch = None
            if items:
                batch = TranscriptBatch(self.sid, st.next_batch_sequence, st.context_epoch,
                                        items, time.time())
                st.next_batch_sequence += 1
            snapshot = _copy_json(st.to_json())
            self._last_committed = None  # unknown until this step is known to have landed
            step = StepWrite(self.sid, records, batch, rw,
                             CheckpointState.from_json(snapshot), execution)
            early = plants.on("publish_before_commit")  # chaos plant: visible first
            if early:
                for record in records:
                    self._publish(record)
                if records and crashpoints.ARMED:
                    await crashpoints.reach_async("publish")
            commit = asyncio.ensure_future(self.manager.store_commit(step))
            deferred: asyncio.CancelledError | None = None
            while not commit.done():
                try:
                    await asyncio.shield(commit)
                except asyncio.CancelledError as exc:
                    # A cancelled step may still land (its group can already be on the
                    # store's thread): finish it, keep state and publish in step with
                    # the store, then re-raise. Bounded by the store's busy deadline.
                    deferred = exc
                except BaseException:
                    break
            if commit.exception() is not None:
                restored = CheckpointState.from_json(saved[3])
                for name in CheckpointState.__dataclass_fields__:
                    setattr(st, name, getattr(restored, name))
                raise commit.exception()  # type: ignore[misc]
            self._last_committed = snapshot
            if not self.context_evicted:
                if rw is not None:
                    self.context = list(rw.items)
                    self.call_ids = call_ids_of(self.context)
                if batch is not None:
                    self.context.extend(batch.items)
                    self.call_ids.update(call_ids_of(batch.items))
                self.context_len = len(self.context)
            if not early:
                if records and crashpoints.ARMED:
                    await crashpoints.reach_async("publish")  # committed, not yet visible
                for record in records:
                    self._publish(record)
            if deferred is not None:
                raise deferred
            return records

    def publish_live(self, type_: str, payload: dict[str, Any],
                     submission_id: SubmissionId | None) -> None:
        """Publish a live-only delta (never journaled; see ``events``)."""
        if not self.subscribers:
            return
        self._delta_index += 1
        self._publish(ev.live(self.sid, self._last_published, self._delta_index, type_,
                              payload, submission_id))

    def _publish(self, record: EventRecord) -> None:
        if self.fenced:  # given up (lease lost): another supervisor owns it now
            return
        if record.sequence:
            self._last_published = record.sequence
            self._delta_index = 0
        for sub in list(self.subscribers):
            try:
                sub.queue.put_nowait(record)
            except asyncio.QueueFull:
                sub.dropped = True
                self.subscribers.discard(sub)
                log.warning("session %s: dropped a slow subscriber", self.sid)

    async def warn(self, message: str, submission_id: SubmissionId | None = None,
                   **extra: Any) -> None:
        await self.commit([(ev.WARNING, ev.warning(message, **extra), submission_id)])

    # ----------------------------------------------------------------- admit

    async def admit(self, text: str, attachments: list[dict[str, Any]],
                    submission_id: SubmissionId | None) -> None:
        """Run user_prompt_submit hooks on a new input, then queue it durably.

        A rejected prompt is never persisted: only ``turn_started`` and
        ``turn_aborted(rejected)`` (without the prompt) and an execution record
        (aborted) are written. A hook failure fails that turn the same way,
        with an ``error`` event and outcome ``failed``.
        """
        turn_id = TurnId(ev.new_id("turn"))
        async with self._admit_lock:
            try:
                folded = await self.hooks.run(HookEvent.USER_PROMPT_SUBMIT, self.sid, turn_id,
                                              {"text": text, "attachments": attachments})
            except HookFailed as exc:
                await self._refuse(turn_id, submission_id, ev.ABORT_FAILED, str(exc), exc)
                return
            if folded.reject is not None:
                await self._refuse(turn_id, submission_id, ev.ABORT_REJECTED,
                                   f"prompt rejected by a user_prompt_submit hook: "
                                   f"{folded.reject}", None)
                return
            entry = {"submission_id": submission_id, "turn_id": turn_id,
                     "text": folded.text if folded.text is not None else text,
                     "attachments": attachments, "contexts": folded.contexts}
            # Queued input lives in the state row (bounded) until its turn takes it:
            # it may use a quarter of it (docs/storage.md, "Bounds and encoding").
            room = self.store_limits.max_state_bytes // 4
            queued = sum(json_size(e) for e in self.state.queued_input)
            size = json_size(entry)
            if queued + size > room:
                raise BadOp(f"this input is {size} bytes as stored and {queued} bytes of "
                            f"input are queued; a session queues at most {room} bytes "
                            + ("(wait for the running turn to take them)" if queued else
                               "(send a shorter text, or the rest as a file in the "
                               "workspace)"))
            await self.commit(mutate=lambda st: st.queued_input.append(entry))
        self.kick()

    async def _refuse(self, turn_id: TurnId, submission_id: SubmissionId | None, reason: str,
                      message: str, error: TurnError | None) -> None:
        now = time.time()
        events: list[EventSpec] = [(ev.TURN_STARTED, {"turn_id": turn_id}, submission_id)]
        if error is not None:
            events.append((ev.ERROR, ev.error(error.failure), submission_id))
        events.append((ev.TURN_ABORTED, {"turn_id": turn_id, "reason": reason,
                                         "message": ev.clip(message, 4096)}, submission_id))
        record = ExecutionRecord(self.sid, turn_id, "failed" if error else "aborted", 0, 0, 0,
                                 {k: 0 for k in empty_usage()}, now, now, 0.0, None,
                                 f"{reason}: {message}"[:1000])
        await self.commit(events, execution=record)

    # ------------------------------------------------------------- subscribe

    async def subscribe(self, after_sequence: int) -> AsyncIterator[EventRecord]:
        sub = Subscriber(asyncio.Queue(self.config.subscriber_queue))
        self.subscribers.add(sub)  # before the replay: nothing published can slip by
        last = after_sequence
        if plants.on("replay_overlap"):  # chaos plant: replays two events already sent
            after_sequence = max(0, after_sequence - 2)
        try:
            async for record in self.manager.replay_from(self.sid, after_sequence):
                yield record
                last = record.sequence
            while True:
                if sub.dropped and sub.queue.empty():
                    raise SubscriberDropped(
                        f"subscriber of session {self.sid} fell more than "
                        f"{self.config.subscriber_queue} events behind; resubscribe from "
                        f"sequence {last}", last_sequence=last)
                record = await sub.queue.get()
                if record.sequence == 0:
                    if record.payload.get("after_sequence", 0) >= last:
                        yield record
                elif record.sequence > last:
                    yield record
                    last = record.sequence
        finally:
            self.subscribers.discard(sub)

    # ---------------------------------------------------------------- driver

    def kick(self, work: Work | None = None) -> None:
        """Queue work and make sure a driver task runs it (no await: no race)."""
        if work is not None:
            self.work.append(work)
        if self.driver is None and not self.closed and (self.work or self.state.queued_input):
            self.driver = self.manager.spawn(self._drive(), name=f"session-{self.sid}")

    async def _drive(self) -> None:
        PAUSABLE.set(True)  # this session's own work waits out a store outage
        try:
            if self.context_evicted:
                try:  # waits out a store outage like a commit (outage.py)
                    loaded = await self.manager.load_session(self.sid)
                except StoreError as exc:  # the work stays queued for the next kick
                    log.warning("session %s: its context could not be reloaded: %s",
                                self.sid, exc)
                    return
                if loaded is not None:
                    self.context = list(loaded.context)
                    self.call_ids = call_ids_of(self.context)
                    self.context_evicted = False
            while not self.closed:
                if self.work:
                    work = self.work.popleft()
                elif self.state.queued_input:
                    work = Work("turn")
                else:
                    break
                try:
                    if work.kind in ("session_start", "turn", "compact", "resume"):
                        await self.manager.run_work(self, work)
                    elif work.kind == "shutdown":
                        await self.manager.close_session(self, work.submission_id)
                except asyncio.CancelledError:
                    raise
                except Exception:  # the session's catch-all boundary
                    log.exception("session %s: work %s failed", self.sid, work.kind)
                    await self._report_internal_error(work)
        finally:
            self.driver = None
            self.turn = None
            self.turn_task = None
            if len(self.context) > self.config.idle_context_items and not self.context_evicted:
                self.context = []
                self.call_ids = set()
                self.context_evicted = True
        # New work may have arrived between the last check and here: kick again.
        if not self.closed and (self.work or self.state.queued_input):
            self.kick()

    async def _report_internal_error(self, work: Work) -> None:
        try:
            await self.commit([(ev.ERROR, ev.error(Failure(
                FailureKind.INTERNAL, f"{work.kind} failed inside the supervisor; see its log")),
                                work.submission_id)])
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("session %s: could not even record the failure", self.sid)

    def describe(self) -> dict[str, Any]:
        st = self.state
        return {
            "session_id": self.sid,
            "status": "closed" if self.closed else (
                "paused" if self.store_outage is not None
                else "busy" if self.driver else "idle"),
            "route": self.route_name,
            "workspace": self.spec.workspace,
            "image": self.spec.tool_policy.get("image"),  # its digest (docs/images.md)
            "parent_session_id": self.record.parent_session_id,
            "active_turn": st.active_turn,
            "pending_approval": st.pending_approval,
            "queued_input": len(st.queued_input),
            "context_items": self.context_len,
            "context_epoch": st.context_epoch,
            "compaction_count": st.compaction_count,
            "total_usage": st.total_usage,
            "last_event_sequence": st.next_event_sequence - 1,
            "subscribers": len(self.subscribers),
            **({"store_outage": self.store_outage.view()}
               if self.store_outage is not None else {}),
        }


def call_ids_of(items: Sequence[dict[str, Any]]) -> set[str]:
    """The call_ids of the ``function_call`` items among ``items``."""
    return {i["call_id"] for i in items
            if i.get("type") == "function_call" and isinstance(i.get("call_id"), str)}


def _copy_json(d: Any) -> Any:
    """Deep-copy a JSON-like value (cheaper than copy.deepcopy for our shapes)."""
    if isinstance(d, dict):
        return {k: _copy_json(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_copy_json(v) for v in d]
    return d
