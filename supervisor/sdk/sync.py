"""A synchronous wrapper of the asyncio API, for scripts and notebooks.

``SyncCorral`` runs its own event loop in a private thread and forwards each
call to it, blocking the caller until the answer (each with a deadline). So
it works with no running loop (a script), and also inside one (Jupyter,
IPython): the caller's loop is only blocked for the duration of each call,
and the connection, its heartbeats and the client tools live in the private
loop, never in the caller's. In a notebook the async API with top-level
``await`` avoids even that block; ``SyncCorral`` is for code that cannot await.

Client tools run in the private thread's loop (sync functions in its worker
threads): they must not call back into the same ``SyncCorral`` (that would
wait on itself; ``RuntimeError`` says so).

Invariants:
- One owner task in the private loop enters and leaves the connection (and
  the embedded farm), so their task groups and timeouts live in one task.
- ``close`` (or leaving ``with``) stops the farm and the loop and joins the
  thread; a call after that raises ``RuntimeError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterator,
    Mapping,
    Sequence,
)
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from broker.security import CurveClient
from supervisor.engine.hooks import HookEvent
from supervisor.sdk.corral import Corral, Decision, HookFunction, Session, check_timeout
from supervisor.sdk.events import Event
from supervisor.sdk.farm import EmbeddedFarm
from supervisor.sdk.options import SessionOptions
from supervisor.sdk.tools import ClientTool

T = TypeVar("T")
_START_TIMEOUT_S = 180.0


class SyncCorral:
    """``with SyncCorral.embedded(script=...) as corral:`` or
    ``with SyncCorral.connect(endpoint) as corral:``; then the same calls as
    ``Corral`` / ``Session`` without ``await``."""

    def __init__(self, opener: Callable[[], contextlib.AbstractAsyncContextManager[Corral]],
                 *, timeout_s: float = 60.0) -> None:
        check_timeout(timeout_s)
        self._opener = opener
        self.timeout_s = timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._owner: Future[None] | None = None
        self._stop: asyncio.Event | None = None
        self._corral: Corral | None = None
        self.farm: EmbeddedFarm | None = None

    @classmethod
    def embedded(cls, *, timeout_s: float = 60.0, **farm: Any) -> SyncCorral:
        """An ``EmbeddedFarm(**farm)`` and a connection to it."""
        sync = cls(lambda: sync._embedded(farm), timeout_s=timeout_s)
        return sync

    @classmethod
    def connect(cls, endpoint: str, *, curve: CurveClient | None = None,
                timeout_s: float = 60.0) -> SyncCorral:
        return cls(lambda: Corral(endpoint, curve=curve), timeout_s=timeout_s)

    @classmethod
    def for_home(cls, home: str | Path, *, timeout_s: float = 60.0) -> SyncCorral:
        return cls(lambda: Corral.for_home(home), timeout_s=timeout_s)

    @contextlib.asynccontextmanager
    async def _embedded(self, options: dict[str, Any]) -> AsyncIterator[Corral]:
        async with EmbeddedFarm(**options) as farm, farm.connect() as corral:
            self.farm = farm
            yield corral

    # -- the private loop ---------------------------------------------------

    def __enter__(self) -> SyncCorral:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        loop = asyncio.new_event_loop()
        ready: Future[Corral] = Future()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="corral-sdk-loop",
                                        daemon=True)
        self._thread.start()

        async def owner() -> None:
            self._stop = asyncio.Event()
            try:
                async with self._opener() as corral:
                    ready.set_result(corral)
                    await self._stop.wait()
            except BaseException as exc:
                if not ready.done():
                    ready.set_exception(exc)
                raise

        self._owner = asyncio.run_coroutine_threadsafe(owner(), loop)
        try:
            self._corral = ready.result(_START_TIMEOUT_S)
        except BaseException:
            self._shutdown_loop()
            raise

    def close(self) -> None:
        loop, owner = self._loop, self._owner
        if loop is None or owner is None:
            return
        if self._stop is not None:
            loop.call_soon_threadsafe(self._stop.set)
        try:
            owner.result(_START_TIMEOUT_S)
        finally:
            self._shutdown_loop()

    def _shutdown_loop(self) -> None:
        loop, self._loop = self._loop, None
        self._corral = None
        if loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(30)
        loop.close()

    def _run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        loop = self._loop
        if loop is None:
            coro.close()
            raise RuntimeError("this SyncCorral is closed")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a client tool or hook called its own SyncCorral; use the "
                               "async API inside them")
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s or self.timeout_s)

    @property
    def corral(self) -> Corral:
        if self._corral is None:
            raise RuntimeError("this SyncCorral is not open")
        return self._corral

    # -- the calls ------------------------------------------------------------

    def create_session(self, options: SessionOptions, *, tools: Sequence[ClientTool] = (),
                       hooks: Mapping[str | HookEvent, HookFunction] | None = None
                       ) -> SyncSession:
        session = self._run(self.corral.create_session(options, tools=tools, hooks=hooks))
        return SyncSession(self, session)

    def resume(self, session_id: str, *, tools: Sequence[ClientTool] = (),
               hooks: Mapping[str | HookEvent, HookFunction] | None = None) -> SyncSession:
        return SyncSession(self, self._run(self.corral.resume(session_id, tools=tools,
                                                              hooks=hooks)))

    def list_sessions(self) -> list[dict[str, Any]]:
        return self._run(self.corral.list_sessions())


async def _awaited(aw: Awaitable[T]) -> T:
    return await aw


class SyncSession:
    """``Session`` without ``await``; ``run`` is a plain iterator."""

    def __init__(self, owner: SyncCorral, session: Session) -> None:
        self._owner = owner
        self.session = session
        self.id = session.id

    def run(self, prompt: str, *, timeout_s: float | None = None) -> Iterator[Event]:
        """The turn's events, as ``Session.run``; each wait is bounded by
        ``timeout_s`` (default the wrapper's ``timeout_s``)."""
        wait_s = timeout_s or self._owner.timeout_s
        stream = self.session.run(prompt, timeout_s=wait_s)
        try:
            while True:
                try:
                    yield self._owner._run(_awaited(anext(stream)), wait_s + 5.0)
                except StopAsyncIteration:
                    return
        finally:
            with contextlib.suppress(RuntimeError):
                self._owner._run(_awaited(stream.aclose()), 10.0)

    def describe(self) -> dict[str, Any]:
        return self._owner._run(self.session.describe())

    def approve(self, approval_id: str, decision: Decision = "approved") -> None:
        self._owner._run(self.session.approve(approval_id, decision))

    def interrupt(self, turn_id: str | None = None) -> bool:
        return self._owner._run(self.session.interrupt(turn_id))

    def export(self) -> dict[str, Any]:
        return self._owner._run(self.session.export())

    def terminate(self) -> None:
        self._owner._run(self.session.terminate())
