"""DeltaRelay: ordered, coalesced PARTIALs; the timer starts only when a delta waits."""

from __future__ import annotations

import asyncio
import time

import pytest

from broker.protocol import unpack
from sandbox_worker.api import ModelDelta
from sandbox_worker.model.relay import DeltaRelay


def text(t: str) -> ModelDelta:
    return {"type": "text_delta", "text": t}


async def test_first_delta_leaves_at_once_and_later_ones_are_coalesced() -> None:
    sent: list[tuple[float, dict[str, object]]] = []
    four = asyncio.Event()

    async def send(body: bytes) -> None:
        sent.append((time.monotonic(), unpack(body)))
        if len(sent) == 4:
            four.set()

    relay = DeltaRelay(send, flush_interval_s=0.05)
    try:
        await relay.push([text("a")])
        assert [d for _, d in sent] == [text("a")]
        assert relay._timer is None  # the first token paid for no timer task
        pushed = time.monotonic()
        await relay.push([text("b"), text("c")])
        await relay.push([{"type": "reasoning_delta", "text": "r"}, text("d")])
        assert len(sent) == 1
        assert relay._timer is not None
        async with asyncio.timeout(5):
            await four.wait()  # the timer flushes: "bc", then "r", then "d"
        assert [d for _, d in sent[1:]] == [text("bc"), {"type": "reasoning_delta", "text": "r"},
                                            text("d")]
        assert sent[1][0] - pushed >= 0.045
        assert relay.relayed == 4
    finally:
        await relay.aclose()
    assert relay._timer is None


async def _relay_whose_timer_failed() -> DeltaRelay:
    """A relay whose first delta went out and whose timer then failed to send."""
    async def send(body: bytes) -> None:
        if unpack(body)["text"] != "first":
            raise OSError("socket gone")

    relay = DeltaRelay(send, flush_interval_s=0.001)
    await relay.push([text("first")])
    await relay.push([text("late")])
    timer = relay._timer
    assert timer is not None
    async with asyncio.timeout(5):
        await asyncio.wait([timer])  # it failed (not merely cancelled unstarted)
    assert isinstance(timer.exception(), OSError)
    return relay


async def test_aclose_reports_a_failed_timer_unless_told_not_to() -> None:
    with pytest.raises(RuntimeError, match="delta relay failed"):
        await (await _relay_whose_timer_failed()).aclose()
    quiet = await _relay_whose_timer_failed()
    await quiet.aclose(check=False)  # the attempt's own error is the one raised
    assert quiet._timer is None
