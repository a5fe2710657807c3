"""``SessionManager``: owns every session of one supervisor.

All session work runs as tasks in the manager's one ``TaskGroup`` (``run``);
a session has a task only while it has work, so an idle session is a plain
object. ``run`` first resumes every active session from the store (crash
resume): a pending approval is answerable again, a turn caught mid model call
re-issues its step, a turn caught mid tool call resolves each call from its
durable state; then the turn continues.

Invariants:
- ``submit`` validates before anything changes (``BadOp``, ``UnknownSession``,
  ``SessionClosed`` to the caller); an accepted ``user_input`` is durable
  (``CheckpointState.queued_input``) before ``submit`` returns; input arriving
  during a turn is queued, never dropped.
- Bad input aimed at a live session (stale approval id, stale turn id) becomes
  a durable ``warning`` event; it never kills the session.
- No session, worker or hook can wedge another: each session's work is its own
  task, and the session driver is the catch-all boundary for its bugs.
- Store errors are translated here (``StoreFailed``) at one boundary.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

from sandbox_worker.api import ModelRoute, Usage
from supervisor.engine import events as ev
from supervisor.engine.calls import Broker
from supervisor.engine.command_hooks import command_hooks
from supervisor.engine.config import EngineConfig, SessionSpec
from supervisor.engine.errors import (
    BadOp,
    EngineNotRunning,
    SessionClosed,
    TurnError,
    UnknownSession,
    UsageObserverFailed,
)
from supervisor.engine.hooks import HookEvent, HookRunner, Middleware
from supervisor.engine.looplag import LoopLag
from supervisor.engine.ops import (
    Compact,
    ExecApproval,
    Interrupt,
    SetModel,
    Shutdown,
    UserInput,
    parse_op,
)
from supervisor.engine.outage import Outages, StoreFailed
from supervisor.engine.session import PendingApproval, Session, Work
from supervisor.engine.turn import Turn, run_session_start
from supervisor.store import (
    LeaseLost,
    SessionExists,
    SessionStore,
    StoreBusy,
    StoreError,
    StoreUnavailable,
)
from supervisor.store.records import (
    CheckpointState,
    EventRecord,
    LoadedSession,
    SessionId,
    SessionRecord,
    StepWrite,
    SubmissionId,
)

log = logging.getLogger(__name__)
# An approval answer is acknowledged once its verdicts are committed, waited for
# at most this long (a store held busy or slow delays the commit; never a hang).
APPROVAL_DURABLE_WAIT_S = 10.0

UsageObserver = Callable[[str, Usage], Any]
MiddlewareFactory = Callable[[SessionSpec], Sequence[Middleware]]


class SessionManager:
    def __init__(self, *, store: SessionStore, broker: Broker, config: EngineConfig,
                 middleware_factory: MiddlewareFactory | None = None,
                 usage_observer: UsageObserver | None = None,
                 export_sinks: Sequence[Any] = ()) -> None:
        # A farm may start with no route configured yet (the default corral.toml):
        # sessions then name one (or register one inline), else create fails.
        self.store = store
        self.broker = broker
        self.config = config
        self.middleware_factory = middleware_factory
        self.usage_observer = usage_observer
        self.export_sinks = tuple(export_sinks)
        self.sessions: dict[SessionId, Session] = {}
        self._closed_ids: set[SessionId] = set()
        self._tg: asyncio.TaskGroup | None = None
        self._started = asyncio.Event()
        self.loop_lag = LoopLag()
        # Steps waiting out an unreachable store (outage.py; docs/storage.md).
        self.outages = Outages(config.store_outage_s)
        # Telemetry (supervisor.telemetry.hub): told of each committed step and
        # its latency; None when telemetry is off.
        self.on_commit: Callable[[StepWrite, float], None] | None = None
        # Several supervisors: called before a session taken from another one resumes
        # (the facade re-reads the inline routes the other registered: HOME/routes.json).
        self.before_take_over: Callable[[], None] | None = None

    # ------------------------------------------------------------------ run

    async def run(self) -> None:
        """Own every session task; resume active sessions first; run until cancelled."""
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                tg.create_task(self.loop_lag.run(), name="loop-lag")
                for sid in await self.store.active_sessions():
                    try:
                        await self._resume(sid)
                    except StoreError:
                        log.exception("session %s: could not be resumed", sid)
                self._started.set()
                try:
                    await asyncio.Future()  # until cancelled
                finally:
                    self.outages.abandon()  # steps waiting for the store end now
        finally:
            self._tg = None
            self._started.clear()

    async def started(self) -> None:
        """Wait until ``run`` has resumed the stored sessions and takes ops."""
        await self._started.wait()

    def spawn(self, coro: Coroutine[Any, Any, None], *, name: str) -> asyncio.Task[None]:
        if self._tg is None:
            coro.close()
            raise EngineNotRunning("SessionManager.run is not running")
        return self._tg.create_task(coro, name=name)

    def _middlewares(self, spec: SessionSpec) -> HookRunner:
        mws: list[Middleware] = list(self.middleware_factory(spec)) \
            if self.middleware_factory is not None else []
        mws.extend(command_hooks(self, spec))
        return HookRunner(mws, timeout_s=self.config.hook_timeout_s)

    async def _resume(self, sid: SessionId) -> None:
        loaded = await self.store.load(sid)
        if loaded is None:
            return
        spec = SessionSpec.from_config(loaded.record.config, session_id=sid)
        session = Session(self, loaded.record, loaded.state, list(loaded.context),
                          self._middlewares(spec))
        self.sessions[sid] = session
        pending = loaded.state.pending_approval
        if pending is not None:
            # Answerable at once, even before the resumed turn reaches its wait.
            session.approval = PendingApproval(pending["id"], pending.get("turn_id", ""))
        session.work.append(Work("session_start", source="resume"))
        if loaded.state.active_turn is not None:
            session.work.append(Work("resume"))
        session.kick()

    # ------------------------------------------------- leases (several supervisors)

    def give_up(self, sid: SessionId) -> None:
        """This supervisor lost the session's lease: publish nothing more, drop its
        subscribers (they resubscribe to the new owner from their last sequence), stop
        its work and forget it. Its state is in the store; the new owner resumes it."""
        session = self.sessions.pop(sid, None)
        if session is None:
            return
        log.warning("session %s: lease lost; given up to another supervisor", sid)
        session.fenced = True
        session.closed = True
        for sub in list(session.subscribers):
            sub.dropped = True
            # Wake a subscriber waiting on its empty queue (a live-only record it skips):
            # it sees ``dropped`` and ends, so its client resubscribes and is redirected
            # to the new owner; without this it waited forever (found by corral chaos).
            if sub.queue.empty():
                sub.queue.put_nowait(EventRecord(sid, 0, "given_up", {"after_sequence": -1}))
        session.subscribers.clear()
        if session.driver is not None and session.driver is not asyncio.current_task():
            session.driver.cancel()

    async def take_over(self, sid: SessionId) -> None:
        """Resume a session whose lease this supervisor just took, as after a restart."""
        if sid not in self.sessions:
            if self.before_take_over is not None:
                self.before_take_over()
            await self._resume(sid)

    # --------------------------------------------------------------- public

    async def create_session(self, spec: SessionSpec) -> SessionId:
        if self._tg is None:
            raise EngineNotRunning("SessionManager.run is not running")
        spec.validate(self.config)
        sid = SessionId(spec.session_id or ev.new_id("sess"))
        if sid in self.sessions:
            raise BadOp(f"session {sid} already exists")
        if spec.parent_session_id is not None and spec.route is None:
            parent = self.sessions.get(SessionId(spec.parent_session_id))
            if parent is not None and parent.spec.child_route is not None:
                spec.route = parent.spec.child_route
        record = SessionRecord(sid, time.time(), spec.to_config(),
                               parent_session_id=SessionId(spec.parent_session_id)
                               if spec.parent_session_id else None)
        state = CheckpointState(route=spec.route)
        first = ev.durable(sid, 1, ev.SESSION_CONFIGURED, {
            "route": spec.route or self.config.default_route, "workspace": spec.workspace,
            "parent_session_id": spec.parent_session_id, "tools": spec.tools}, None)
        state.next_event_sequence = 2
        try:
            await self.store.create_session(record, StepWrite(sid, [first], state=state))
        except StoreError as exc:
            if isinstance(exc, SessionExists):
                raise BadOp(f"session {sid} already exists") from exc
            raise StoreFailed(f"could not create the session: {exc}",
                              kind="store_unavailable" if isinstance(exc, StoreUnavailable)
                              else StoreFailed.kind, retryable=exc.retryable) from exc
        session = Session(self, record, CheckpointState.from_json(state.to_json()), [],
                          self._middlewares(spec))
        self.sessions[sid] = session
        session.kick(Work("session_start", source="startup"))
        return sid

    def _session(self, session_id: str) -> Session:
        session = self.sessions.get(SessionId(session_id))
        if session is None:
            if session_id in self._closed_ids:
                raise SessionClosed(f"session {session_id} is shut down")
            raise UnknownSession(f"no session {session_id!r}")
        return session

    async def submit(self, session_id: SessionId, op: dict[str, Any]) -> SubmissionId:
        if self._tg is None or not self._started.is_set():
            # Still resuming the stored sessions after a restart: a session not
            # resumed yet is not unknown, so answer "not running" (retryable).
            raise EngineNotRunning("SessionManager.run is not running")
        session = self._session(session_id)
        parsed = parse_op(op)
        if session.closed:
            raise SessionClosed(f"session {session_id} is shut down")
        sub = SubmissionId(ev.new_id("sub"))
        if isinstance(parsed, UserInput):
            # Prompt hooks run now; only an accepted prompt is ever persisted, and it
            # is durable (queued) before submit returns.
            await session.admit(parsed.text, [a.to_json() for a in parsed.attachments], sub)
        elif isinstance(parsed, Interrupt):
            turn = session.turn
            durable = session.state.active_turn
            if turn is None and durable is not None and durable.get("turn_id") == parsed.turn_id:
                session.pending_interrupt = parsed.turn_id  # a resumed turn not yet running
            elif turn is None:
                await session.warn(ev.NO_ACTIVE_TURN, sub, turn_id=parsed.turn_id)
            elif turn.turn_id != parsed.turn_id:
                await session.warn(ev.STALE_INTERRUPT, sub, turn_id=parsed.turn_id,
                                   active_turn_id=turn.turn_id)
            else:
                turn.interrupt()
        elif isinstance(parsed, ExecApproval):
            waiter = session.approval
            if waiter is None or waiter.approval_id != parsed.id or waiter.future.done():
                await session.warn(ev.STALE_APPROVAL, sub, approval_id=parsed.id)
            else:
                waiter.future.set_result(parsed.decision)
                try:  # acknowledged once durable (bounded: a slow store is not a hang)
                    async with asyncio.timeout(APPROVAL_DURABLE_WAIT_S):
                        await asyncio.shield(waiter.applied)
                except TimeoutError:
                    log.warning("session %s: approval %s: its verdicts were not committed "
                                "within %.0fs of the answer", session_id, parsed.id,
                                APPROVAL_DURABLE_WAIT_S)
        elif isinstance(parsed, SetModel):
            if parsed.route not in self.config.routes:
                raise BadOp(f"unknown route {parsed.route!r}; known: {sorted(self.config.routes)}")

            def set_route(st: CheckpointState) -> None:
                st.route = parsed.route
            await session.commit([(ev.SESSION_CONFIGURED, {"route": parsed.route}, sub)],
                                 mutate=set_route)
        elif isinstance(parsed, Compact):
            if session.turn is not None and not session.turn.finishing:
                session.turn.force_compact = True  # before its next model step
            else:
                session.kick(Work("compact", submission_id=sub))
        elif isinstance(parsed, Shutdown):
            if session.turn is not None:
                session.turn.interrupt()
            session.kick(Work("shutdown", submission_id=sub))
        return sub

    async def close_session(self, session: Session, submission_id: SubmissionId | None) -> None:
        try:
            await session.hooks.run(HookEvent.SESSION_END, session.sid, None,
                                    {"reason": "shutdown"})
        except TurnError as exc:
            await session.warn(f"session_end hook failed: {exc}", submission_id)
        await session.commit([(ev.SESSION_CONFIGURED, {"status": "closed"}, submission_id)])
        session.closed = True
        await self.store.set_status(session.sid, "closed")
        # A closed session leaves memory (its history stays in the store).
        self.sessions.pop(session.sid, None)
        self._closed_ids.add(session.sid)
        await self._release(session.sid)

    async def _release(self, sid: SessionId) -> None:
        """Several supervisors: give a closed session's lease up at once, so it is not
        counted as this supervisor's load and any supervisor can delete it."""
        release = getattr(self.store, "release", None)
        if release is None or getattr(self.store, "owner", None) is None:
            return
        try:
            await release(sid)
        except StoreError as exc:  # it lapses instead, or the next delete here takes it
            log.warning("session %s: closed, its lease not released: %s", sid, exc)

    def subscribe(self, session_id: SessionId, *,
                  after_sequence: int = 0) -> AsyncIterator[EventRecord]:
        if not self._started.is_set():
            # Resuming after a restart: wait for it, or a live session would be
            # served as replay-only (its stream would end instead of following).
            return self._subscribe_when_started(session_id, after_sequence)
        session = self.sessions.get(SessionId(session_id))
        if session is None:
            return self._replay_only(session_id, after_sequence)
        return session.subscribe(after_sequence)

    async def _subscribe_when_started(self, session_id: SessionId,
                                      after_sequence: int) -> AsyncIterator[EventRecord]:
        await self._started.wait()
        async for record in self.subscribe(session_id, after_sequence=after_sequence):
            yield record

    async def _replay_only(self, session_id: str,
                           after_sequence: int) -> AsyncIterator[EventRecord]:
        if await self.store.get_session(SessionId(session_id)) is None:
            raise UnknownSession(f"no session {session_id!r}")
        async for record in self.replay_from(SessionId(session_id), after_sequence):
            yield record

    async def replay_from(self, sid: SessionId, after_sequence: int) -> AsyncIterator[EventRecord]:
        last = after_sequence
        while True:
            page = await self.store.events_page(sid, after_sequence=last, limit=500)
            for record in page.items:
                yield record
                last = record.sequence
            if page.next_cursor is None or not page.items:
                return

    async def list_sessions(self, *, after: str | None = None, limit: int = 100) -> Any:
        return await self.store.list_sessions(after=after, limit=limit)

    async def describe(self, session_id: SessionId) -> dict[str, Any]:
        if not self._started.is_set():
            # Still resuming: a session not resumed yet would be described from
            # its record alone (no last event), so answer "not running" (retryable).
            raise EngineNotRunning("SessionManager.run is not running")
        session = self.sessions.get(SessionId(session_id))
        if session is not None:
            return session.describe()
        record = await self.store.get_session(SessionId(session_id))
        if record is None:
            raise UnknownSession(f"no session {session_id!r}")
        return {"session_id": record.session_id, "status": record.status,
                "parent_session_id": record.parent_session_id}

    def stats(self) -> dict[str, Any]:
        busy = sum(1 for s in self.sessions.values() if s.driver is not None)
        closed = sum(1 for s in self.sessions.values() if s.closed)
        return {
            "sessions": len(self.sessions),
            "sessions_active": busy,
            "sessions_idle": len(self.sessions) - busy - closed,
            "sessions_closed": closed,
            "turns_running": sum(1 for s in self.sessions.values() if s.turn is not None),
            "pending_approvals": sum(1 for s in self.sessions.values()
                                     if s.state.pending_approval is not None),
            "queued_inputs": sum(len(s.state.queued_input) for s in self.sessions.values()),
            "sessions_paused_store": sum(1 for s in self.sessions.values()
                                         if s.store_outage is not None),
            "loop_lag_s": round(self.loop_lag.last_s, 4),
            "loop_lag_max_60s_s": round(self.loop_lag.window_max_s, 4),
        }

    # -------------------------------------------------------- engine helpers

    async def run_work(self, session: Session, work: Work) -> None:
        """Run one unit of a session's work (its driver calls this: the session
        module never imports the turn driver)."""
        if work.kind == "session_start":
            await run_session_start(session, work.source)
            return
        turn = Turn.for_work(session, work)
        if turn is not None:
            await turn.drive()

    def route(self, name: str) -> ModelRoute:
        route = self.config.routes.get(name)
        if route is None:
            raise TurnError(f"unknown route {name!r}", kind="bad_route")
        return route

    async def observe_usage(self, route: str, usage: Usage) -> None:
        if self.usage_observer is None:
            return
        try:
            result = self.usage_observer(route, usage)
            if inspect.isawaitable(result):
                await result
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # foreign code: translate at this boundary
            raise UsageObserverFailed(f"the usage observer failed: {exc}") from exc

    async def store_commit(self, step: StepWrite) -> None:
        """Commit one step; a busy store is retried for ``store_retry_s``; an unreachable
        one is waited out (``outage.py``: the session is paused, visibly)."""
        started = time.monotonic()
        deadline = started + self.config.store_retry_s
        sid = step.session_id
        epoch_of = getattr(self.store, "epoch_of", None)
        while True:
            epoch: int | None = epoch_of(sid) if epoch_of is not None else None
            try:
                await self.store.commit(step)
                if self.on_commit is not None:
                    self.on_commit(step, time.monotonic() - started)
                self.outages.resumed(sid, self.sessions.get(sid))
                return
            except LeaseLost as exc:  # another supervisor owns the session now?
                if epoch is not None and await self._lease_back(sid, epoch):
                    continue
                self.give_up(sid)
                raise StoreFailed(f"the session's lease was lost: {exc}",
                                  kind="lease_lost") from exc
            except StoreUnavailable as exc:
                await self.outages.wait(sid, self.sessions.get(sid), exc)
            except StoreBusy as exc:
                if time.monotonic() >= deadline:
                    raise StoreFailed(f"the store stayed busy: {exc}",
                                      retryable=True) from exc
                await asyncio.sleep(0.05)
            except StoreError as exc:
                raise StoreFailed(f"the store refused a step: {exc}",
                                  retryable=exc.retryable) from exc

    async def load_session(self, sid: SessionId) -> LoadedSession | None:
        """``store.load`` for a session's work: an unreachable store is waited out as
        for a commit (a step past the deadline raises ``StoreFailed``)."""
        while True:
            try:
                loaded = await self.store.load(sid)
            except StoreUnavailable as exc:
                await self.outages.wait(sid, self.sessions.get(sid), exc)
                continue
            self.outages.resumed(sid, self.sessions.get(sid))
            return loaded

    async def _lease_back(self, sid: SessionId, epoch: int) -> bool:
        """A write under ``epoch`` was refused: True if this supervisor still owns the
        session (its lease lapsed during a store outage and nobody took it: taken back
        under a new epoch, or already taken back by the lease keeper), so the same step
        is written again; False if another supervisor acquired it (give it up)."""
        reacquire = getattr(self.store, "reacquire", None)
        if reacquire is None:
            return False
        try:
            now: int | None = await reacquire(sid, epoch)
        except StoreUnavailable:
            return True  # gone again: the next attempt waits for it
        except StoreError as exc:
            log.warning("session %s: could not take its lapsed lease back: %s", sid, exc)
            return False
        if now is not None:
            log.warning("session %s: its lease lapsed while the store was unreachable; "
                        "nobody took it: kept under epoch %d", sid, now)
        return now is not None
