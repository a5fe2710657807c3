"""Group commit, independent of the database: a bounded queue of write operations and
the one task that applies them, a group per transaction.

``submit(op)`` appends the operation and awaits its future. The task takes everything
pending (up to ``max_group_ops``), hands the group to ``apply`` (which runs it in ONE
transaction and returns one ``(ok, value_or_error)`` per operation), and only then
resolves each awaiter: commit before visible.

Invariants:
- Pending operations are bounded (``max_pending_ops``); past it ``submit`` raises
  ``StoreBusy`` at once.
- A failure of the whole group (``StoreError``) fails each of its callers with it, and
  the task goes on with the next group; an unexpected exception fails the group's
  callers and is logged, the task goes on.
- The task is owned: ``start`` creates it, ``close`` drains what is pending, awaits the
  task, and fails anything left with ``StoreClosed``. A cancelled caller's operation
  may still commit (writes are idempotent by key).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

from broker.ratelog import RateLimitedLog
from supervisor.store.errors import StoreBusy, StoreClosed, StoreError

log = logging.getLogger(__name__)
Op = TypeVar("Op")
Apply = Callable[[Sequence[Op]], Awaitable[list[tuple[bool, Any]]]]


class GroupCommitter(Generic[Op]):
    def __init__(self, apply: Apply[Op], *, max_group_ops: int, max_pending_ops: int,
                 name: str) -> None:
        self._apply = apply
        self._max_group_ops = max_group_ops
        self._max_pending_ops = max_pending_ops
        self._name = name
        self._pending: list[tuple[Op, asyncio.Future[Any]]] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self.groups_committed = 0
        self.ops_committed = 0
        # A store outage fails every group: one line per 10 s, with the count.
        self._failures = RateLimitedLog(log, 10.0)

    @property
    def closing(self) -> bool:
        return self._closing

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name=self._name)

    async def close(self) -> None:
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task

    def enqueue(self, op: Op) -> asyncio.Future[Any]:
        if self._closing:
            raise StoreClosed("the store is closed")
        if len(self._pending) >= self._max_pending_ops:
            raise StoreBusy(f"write queue full ({self._max_pending_ops} operations pending)")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append((op, future))
        self._wake.set()
        return future

    async def submit(self, op: Op) -> Any:
        return await self.enqueue(op)

    async def _loop(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._pending:
                    group = self._pending[: self._max_group_ops]
                    del self._pending[: len(group)]
                    await self._flush(group)
                if self._closing:
                    return
        finally:
            for _, future in self._pending:
                if not future.done():
                    future.set_exception(StoreClosed("the store was closed"))
            self._pending.clear()

    async def _flush(self, group: list[tuple[Op, asyncio.Future[Any]]]) -> None:
        ops = [op for op, _ in group]
        try:
            results = await self._apply(ops)
        except StoreError as exc:
            self._failures.warning("failed", "store group of %d operations failed: %s",
                                   len(ops), exc)
            self._fail(group, exc)
            return
        except Exception as exc:  # a bug: fail this group's callers, keep serving others
            log.exception("store group of %d operations failed unexpectedly", len(ops))
            self._fail(group, exc)
            return
        except asyncio.CancelledError:
            self._fail(group, StoreClosed("the store's writer was cancelled"))
            raise
        self.groups_committed += 1
        self.ops_committed += len(ops)
        for (_, future), (ok, value) in zip(group, results, strict=True):
            if future.done():  # the caller was cancelled; the write is committed anyway
                continue
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

    @staticmethod
    def _fail(group: list[tuple[Op, asyncio.Future[Any]]], exc: BaseException) -> None:
        for _, future in group:
            if not future.done():
                future.set_exception(exc)


class GroupCounts:
    """The counters of a store's group commit, for tests and benchmarks
    (``SessionStore.groups_committed`` / ``ops_committed``): mixed into both stores,
    which own their committer as ``_group``."""

    _group: GroupCommitter[Any]

    @property
    def groups_committed(self) -> int:
        """Transactions committed (a group each)."""
        return self._group.groups_committed

    @property
    def ops_committed(self) -> int:
        """Operations committed in those transactions."""
        return self._group.ops_committed
