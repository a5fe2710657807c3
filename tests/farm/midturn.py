"""The supervisor SIGKILLed in the middle of a turn, shared by the farm tests on SQLite
(test_farm_e2e) and on PostgreSQL (test_pg_farm): a session on a running farm, a
turn whose tool call is under way when the supervisor dies, the tree restarting it,
and the turn ending from what the store holds.

``kill_supervisor_mid_turn`` returns what a client saw, for the caller's assertions;
every wait has a deadline and the event collector is cancelled on every path.
``collecting`` and ``signal_in_tool_call`` are its steps, shared with the farm tests
that pause a supervisor instead (test_pg_supervisors)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.client import SupervisorClient, SupervisorError
from tests.helpers import eventually

SLOW_TOOL_SCRIPT = {"responses": [
    {"tool_calls": [{"name": "shell", "arguments": {"command": "sleep 2; echo slow"}}]},
    {"text": "finished", "usage": {"input": 10, "output": 3}},
]}


async def has_event(seen: list[dict[str, Any]], kind: str) -> bool:
    return any(e["type"] == kind for e in seen)


async def restarted(farm: Any, old: int) -> bool:
    child = farm.farm.tree.children["supervisor"]
    return child.pid != old and child.state == "running"


async def turn_ended(seen: list[dict[str, Any]], sub: str) -> bool:
    return any(e.get("submission_id") == sub and e["type"] in ("turn_complete", "turn_aborted")
               for e in seen)


@dataclass
class MidTurnKill:
    sid: str
    sub: str
    seen: list[dict[str, Any]]  # every event the client saw, across the restart
    history: dict[str, Any]  # the session's history read after the turn ended

    @property
    def end(self) -> dict[str, Any]:
        return next(e for e in self.seen if e["type"] in ("turn_complete", "turn_aborted")
                    and e.get("submission_id") == self.sub)

    @property
    def durable(self) -> list[int]:
        return [e["sequence"] for e in self.seen if e["sequence"] > 0]


@contextlib.asynccontextmanager
async def collecting(client: SupervisorClient, sid: str, *,
                     ended: list[str] | None = None) -> AsyncIterator[list[dict[str, Any]]]:
    """Every event ``client`` receives of session ``sid``, appended to the yielded list
    by a task that is cancelled and awaited on exit. With ``ended``, a
    ``SupervisorError`` that ends the subscription is recorded there (its kind)
    instead of raised."""
    seen: list[dict[str, Any]] = []

    async def collect() -> None:
        try:
            async for e in client.events(sid):
                seen.append(e)
        except SupervisorError as exc:
            if ended is None:
                raise
            ended.append(exc.kind)

    collector = asyncio.create_task(collect())
    try:
        yield seen
    finally:
        collector.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await collector


async def signal_in_tool_call(farm: Any, seen: list[dict[str, Any]], sig: signal.Signals,
                              what: str = "the tool call to start") -> int:
    """Once ``seen`` holds a ``tool_call_begin`` (within 30 s): ``sig`` to the farm's
    supervisor. Returns the pid signalled."""
    await eventually(lambda: has_event(seen, "tool_call_begin"), timeout_s=30, what=what)
    pid: int = farm.pid("supervisor")
    os.kill(pid, sig)
    return pid


async def kill_supervisor_mid_turn(farm: Any, ws: Path) -> MidTurnKill:
    """On ``farm`` (a ``RunningFarm`` serving ``SLOW_TOOL_SCRIPT``): a session on
    ``ws``, a turn, the supervisor SIGKILLed once its tool call began, then the
    turn awaited to its end through the restarted supervisor."""
    async with SupervisorClient(farm.endpoint) as sv:
        sid = await sv.create_session(workspace=str(ws))
        sub = await sv.submit(sid, {"type": "user_input", "text": "go"})
        async with collecting(sv, sid) as seen:
            old = await signal_in_tool_call(farm, seen, signal.SIGKILL)
            await eventually(lambda: restarted(farm, old), timeout_s=30,
                             what="the supervisor restarted")
            await eventually(lambda: turn_ended(seen, sub), timeout_s=60,
                             what="the turn to end after the restart")
        history = await sv.history(sid)
    return MidTurnKill(sid, sub, seen, history)
