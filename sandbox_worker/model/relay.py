"""Coalescing neutral deltas into ordered PARTIALs.

Providers send a delta per token or word; one broker PARTIAL per delta would
make the broker hop the bottleneck of a fast stream. The relay merges
adjacent deltas of the same kind (text with text, reasoning with reasoning,
arguments of the same tool call) and sends them:

- at once, for the very first delta of an attempt (first-token latency);
- when ``max_chars`` are pending;
- otherwise at most ``flush_interval_s`` after the oldest pending delta (a
  timer task, started the first time a delta has to wait, so an attempt that
  never coalesces, and the first token of every attempt, pay no task for it),
  and at ``flush``.

Invariants:
- Deltas reach ``send`` in exactly the order they were pushed; a merged delta
  holds its parts in order. A change of kind or of tool call flushes first.
- ``relayed`` counts the PARTIALs sent, so a failed attempt knows whether the
  client saw output that it must now discard.
- The owner calls ``aclose`` on every exit: it cancels and awaits the timer,
  so no task outlives the attempt.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Final

from broker.protocol import pack
from sandbox_worker.api import ModelDelta
from sandbox_worker.model.secrets import redact_value

DEFAULT_FLUSH_INTERVAL_S: Final = 0.005
DEFAULT_MAX_CHARS: Final = 16 * 1024

Send = Callable[[bytes], Awaitable[None]]


def _payload(delta: ModelDelta) -> str:
    return delta.get("arguments_delta", "") if delta["type"] == "tool_call_delta" else \
        delta.get("text", "")


class DeltaRelay:
    def __init__(self, send: Send, *, flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
                 max_chars: int = DEFAULT_MAX_CHARS) -> None:
        self._send = send
        self._interval_s = flush_interval_s
        self._max_chars = max_chars
        # Pending deltas, each with the list of its payload parts (joined at flush,
        # so merging n small deltas costs O(n), not O(n^2) string copies).
        self._pending: list[tuple[ModelDelta, list[str]]] = []
        self._pending_chars = 0
        self._pending_since = 0.0
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._timer: asyncio.Task[None] | None = None
        self.relayed = 0

    def _merge(self, delta: ModelDelta) -> None:
        text = _payload(delta)
        self._pending_chars += len(text)
        if self._pending:
            last, parts = self._pending[-1]
            if last["type"] == delta["type"] and (
                    delta["type"] != "tool_call_delta"
                    or (last.get("index") == delta.get("index") and "call_id" not in delta)):
                parts.append(text)
                return
        else:
            self._pending_since = time.monotonic()
        self._pending.append((delta, [text]))

    async def push(self, deltas: list[ModelDelta]) -> None:
        for delta in deltas:
            self._merge(delta)
        if not self._pending:
            return
        if self.relayed == 0 or self._pending_chars >= self._max_chars or (
                time.monotonic() - self._pending_since >= self._interval_s):
            await self.flush()
        else:
            self._wake.set()
            if self._timer is None:
                self._timer = asyncio.get_running_loop().create_task(self._run(),
                                                                     name="delta-relay-timer")

    async def flush(self) -> None:
        async with self._lock:
            pending, self._pending, self._pending_chars = self._pending, [], 0
            self._wake.clear()
            for delta, parts in pending:
                out = dict(delta)
                out["arguments_delta" if delta["type"] == "tool_call_delta" else "text"] = \
                    "".join(parts)
                await self._send(pack(redact_value(out)))
                self.relayed += 1

    async def aclose(self, *, check: bool = True) -> None:
        """Stop the timer; with ``check``, raise ``RuntimeError`` if it had failed
        (its send raised)."""
        timer, self._timer = self._timer, None
        if timer is None:
            return
        timer.cancel()
        await asyncio.wait([timer])
        if check and not timer.cancelled() and timer.exception() is not None:
            raise RuntimeError("delta relay failed") from timer.exception()

    async def _run(self) -> None:
        """The timer: flushes pending deltas ``flush_interval_s`` after they arrive."""
        while True:
            await self._wake.wait()
            delay = self._pending_since + self._interval_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if self._pending:
                await self.flush()
            else:
                self._wake.clear()
