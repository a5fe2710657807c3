"""A farm with two brokers (``[farm] brokers = 2``) keeps running turns while either
broker is SIGKILLed, and a supervisor whose broker hangs (SIGSTOP: silent, never
restarted by the tree) moves its new calls to the other within its liveness
window. Nothing is lost: every tool call that began ends with an outcome, every
turn ends, none is wedged."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from supervisor.client import SupervisorClient
from tests.helpers import eventually

pytestmark = pytest.mark.timeout(150)
log = logging.getLogger(__name__)

TURNS = 60  # the script's length in turns; far more than the test runs
SCRIPT = {"responses": [entry for i in range(TURNS) for entry in (
    {"tool_calls": [{"name": "shell", "arguments": {"command": f"sleep 0.2; echo {i}"}}]},
    {"text": f"turn {i} done", "usage": {"input": 10, "output": 3}})]}
WINDOW_S = 0.25 * 4  # the farm's default heartbeat interval x liveness


class Driver:
    """Runs turns back to back on one session and keeps every event."""

    def __init__(self, sv: SupervisorClient, sid: str) -> None:
        self.sv, self.sid = sv, sid
        self.events: list[dict[str, Any]] = []
        self.ends: list[str] = []  # the type of each turn's end, in order
        self.stop = False
        self._seen = asyncio.Event()  # set at each event received

    async def run(self) -> None:
        collector = asyncio.create_task(self._collect())
        try:
            while not self.stop:
                sub = await self.sv.submit(self.sid, {"type": "user_input", "text": "go"})
                async with asyncio.timeout(60):  # a wedged turn fails the test here
                    while (end := self._end_of(sub)) is None:
                        self._seen.clear()
                        await self._seen.wait()
                self.ends.append(end)
        finally:
            collector.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await collector

    async def _collect(self) -> None:
        async for event in self.sv.events(self.sid):
            self.events.append(event)
            self._seen.set()

    def _end_of(self, sub: str) -> str | None:
        for e in reversed(self.events):
            if e.get("submission_id") == sub and e["type"] in ("turn_complete",
                                                                "turn_aborted"):
                return str(e["type"])
        return None


async def brokers_seen(sv: SupervisorClient) -> list[dict[str, Any]]:
    status = await sv.status()
    return list(status["broker"].get("brokers", []))


async def test_turns_go_on_while_either_broker_is_killed_or_hangs(
        start_farm: Callable[..., Any], workspace_root: Path) -> None:
    farm = await start_farm(SCRIPT, workers=2, extra="[farm]\nbrokers = 2\n")
    tree = farm.farm.tree
    async with SupervisorClient(farm.endpoint) as sv:
        drivers = []
        for n in range(2):
            ws = workspace_root / f"ws{n}"
            ws.mkdir()
            drivers.append(Driver(sv, await sv.create_session(workspace=str(ws))))
        tasks = [asyncio.create_task(d.run()) for d in drivers]

        async def progress(after: int) -> bool:
            for t in tasks:
                if t.done():
                    t.result()  # a driver's failure (a wedged turn) fails the test now
            return sum(len(d.ends) for d in drivers) >= after

        try:
            await eventually(lambda: progress(2), timeout_s=30, what="first turns")
            for name in ("broker", "broker-2"):
                old = farm.pid(name)
                done = sum(len(d.ends) for d in drivers)
                os.kill(old, signal.SIGKILL)
                await eventually(functools.partial(progress, done + 4), timeout_s=40,
                                 what=f"4 more turns after {name} was SIGKILLed")
                assert tree.children[name].pid != old  # the tree restarted it

            # A hung broker: silent, so the supervisor must decide it is lost itself.
            current = next(b for b in await brokers_seen(sv) if b["current"])
            name = "broker" if current["endpoint"] == farm.farm.paths.broker_frontend \
                else "broker-2"
            hung = farm.pid(name)
            os.kill(hung, signal.SIGSTOP)
            t0 = time.monotonic()
            try:
                async def moved() -> bool:
                    seen = await brokers_seen(sv)
                    return any(b["current"] and b["endpoint"] != current["endpoint"]
                               for b in seen)
                await eventually(moved, timeout_s=10, interval_s=0.05,
                                 what="new calls moved off the hung broker")
                moved_s = time.monotonic() - t0
                log.warning("supervisor moved off a hung broker in %.2f s (window %.2f s)",
                            moved_s, WINDOW_S)
                # Lost = silent for the window, checked every heartbeat interval.
                assert moved_s <= WINDOW_S + 2 * 0.25 + 1.5, moved_s
                done = sum(len(d.ends) for d in drivers)
                await eventually(lambda: progress(done + 4), timeout_s=40,
                                 what="4 more turns while a broker hangs")
            finally:
                os.kill(hung, signal.SIGKILL)  # the tree restarts it
            await eventually(lambda: _running_again(tree, name, hung), timeout_s=30,
                             what=f"{name} restarted")
        finally:
            for d in drivers:
                d.stop = True
            results = await asyncio.gather(*tasks, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    for d in drivers:
        assert d.ends
        assert set(d.ends) <= {"turn_complete"}, d.ends
        begun = {e["payload"]["call_id"] for e in d.events if e["type"] == "tool_call_begin"}
        ended = {e["payload"]["call_id"]: e["payload"]["outcome"] for e in d.events
                 if e["type"] == "tool_call_end"}
        assert begun == set(ended), "a tool call began and never ended"
        assert set(ended.values()) <= {"ok", "unknown"}, ended
        durable = [e["sequence"] for e in d.events if e["sequence"] > 0]
        assert durable == list(range(1, len(durable) + 1)), "gap or duplicate"


async def _running_again(tree: Any, name: str, old: int) -> bool:
    child = tree.children[name]
    return bool(child.pid != old and child.state == "running")
