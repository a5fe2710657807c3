"""Helpers of the crash matrix: watch a session live across supervisor
restarts, then check what the live view, the store and the workspace say.

The checks (issue 6, "Must show"):
- the durable events a client saw live are dense from 1 and equal (sequence,
  type, payload) to the store's replay: nothing lost, nothing duplicated;
- no non-idempotent tool effect happened twice (each shell call appends one
  line to ``effects.log`` in the workspace), and an ``ok`` call's effect
  happened exactly once;
- the turn ended exactly once, complete or aborted, and its execution record
  in the store has the matching terminal outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.client import SupervisorClient, SupervisorError, SupervisorUnavailable
from tests.helpers import eventually

TERMINAL = ("turn_complete", "turn_aborted")
MARK = "echo m-{n} >> effects.log"


def shell_call(n: int, then: str = "echo done") -> dict[str, Any]:
    return {"name": "shell", "arguments": {"command": f"{MARK.format(n=n)}; {then}"}}


@dataclass
class Watch:
    """Collects every event of one session, live, across supervisor restarts."""

    sv: SupervisorClient
    sid: str
    seen: list[dict[str, Any]] = field(default_factory=list)
    arrived: dict[int, float] = field(default_factory=dict)  # sequence -> wall time
    task: asyncio.Task[None] | None = None

    async def _collect(self) -> None:
        async for e in self.sv.events(self.sid):
            self.seen.append(e)
            if e["sequence"] > 0:
                self.arrived[e["sequence"]] = time.time()

    def start(self) -> None:
        self.task = asyncio.create_task(self._collect())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    def first(self, kind: str, sub: str | None = None) -> dict[str, Any] | None:
        return next((e for e in self.seen if e["type"] == kind
                     and (sub is None or e.get("submission_id") == sub)), None)

    async def terminal(self, sub: str, timeout_s: float = 60) -> dict[str, Any]:
        async def done() -> dict[str, Any] | None:
            return next((e for e in self.seen if e["type"] in TERMINAL
                         and e.get("submission_id") == sub), None)
        found = await eventually(done, timeout_s=timeout_s, what=f"the end of turn {sub}")
        assert found is not None
        return found


async def call_retrying(sv: SupervisorClient, timeout_s: float, name: str,
                        **args: Any) -> Any:
    """A call that rides out a supervisor restart (unavailable, or not ready yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await sv.call(name, timeout_s=2.0, **args)
        except SupervisorUnavailable:
            pass
        except SupervisorError as exc:
            if exc.kind != "unavailable":
                raise
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} did not succeed within {timeout_s}s")
        await asyncio.sleep(0.05)


async def full_history(sv: SupervisorClient, sid: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    after = 0
    while True:
        page = await call_retrying(sv, 30, "history", session_id=sid, after_sequence=after,
                                   limit=5000)
        out.extend(page["events"])
        if page["next"] is None or not page["events"]:
            return out
        after = page["events"][-1]["sequence"]


def executions(db: Path) -> dict[str, str]:
    """turn id -> outcome, read straight from the SQLite file (read-only)."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        return dict(conn.execute("SELECT turn_id, outcome FROM executions").fetchall())
    finally:
        conn.close()


def effects(ws: Path) -> Counter[str]:
    path = ws / "effects.log"
    lines = path.read_text().split() if path.exists() else []
    return Counter(lines)


async def check_invariants(watch: Watch, ws: Path, db: Path) -> list[dict[str, Any]]:
    """The matrix's common assertions; returns the store's replay."""
    replay = await full_history(watch.sv, watch.sid)
    live = [e for e in watch.seen if e["sequence"] > 0]
    seqs = [e["sequence"] for e in live]
    assert seqs == list(range(1, len(seqs) + 1)), f"live view has a gap or duplicate: {seqs}"

    def key(e: dict[str, Any]) -> tuple[Any, ...]:
        return e["sequence"], e["type"], e.get("submission_id"), e["payload"]
    assert [key(e) for e in replay[:len(live)]] == [key(e) for e in live], \
        "the store's replay differs from what the client saw live"
    # Everything durable that was published before the live view stopped.
    assert len(replay) >= len(live)
    # Tool effects: at most once each; exactly once for an ok call.
    counts = effects(ws)
    assert all(c == 1 for c in counts.values()), f"a tool effect happened twice: {counts}"
    ends = [e for e in replay if e["type"] == "tool_call_end"]
    per_call = Counter(e["payload"]["call_id"] for e in ends)
    assert all(c == 1 for c in per_call.values()), f"a call ended twice: {per_call}"
    begins = {e["payload"]["call_id"]: e for e in replay if e["type"] == "tool_call_begin"}
    for end in ends:
        marker = _marker(begins.get(end["payload"]["call_id"]))
        if end["payload"]["outcome"] == "ok" and marker is not None:
            assert counts[marker] == 1, f"ok call without its effect: {end}"
    # Every turn ended exactly once, with a matching terminal execution record.
    outcomes = executions(db)
    started = [e["payload"]["turn_id"] for e in replay if e["type"] == "turn_started"]
    for turn_id in started:
        finals = [e for e in replay if e["type"] in TERMINAL
                  and e["payload"].get("turn_id") == turn_id]
        assert len(finals) == 1, f"turn {turn_id} ended {len(finals)} times"
        want = "completed" if finals[0]["type"] == "turn_complete" else ("aborted", "failed")
        got = outcomes.get(turn_id)
        assert got == want or (isinstance(want, tuple) and got in want), \
            f"turn {turn_id}: execution record {got!r}, terminal {finals[0]['type']}"
    return replay


def exported_checkpoints(home: Path, sid: str) -> int:
    """Every checkpoint file the farm exported verifies; returns how many."""
    from supervisor.export import verify

    files = sorted((home / "exports").glob("*.json"))
    for f in files:
        doc = json.loads(f.read_text())
        assert verify(doc) == [], f"{f.name} does not verify: {verify(doc)}"
        assert doc["descriptor"]["session_id"] == sid
    return len(files)


def unclosed(replay: list[dict[str, Any]]) -> list[str]:
    """Things a client was shown as started that never got their end: a model
    step without ``model_step_completed``, a notice block never ``complete``,
    a tool call without ``tool_call_end``."""
    out: list[str] = []
    steps = {(e["payload"]["turn_id"], e["payload"]["step"]) for e in replay
             if e["type"] == "model_step_started"}
    steps -= {(e["payload"]["turn_id"], e["payload"]["step"]) for e in replay
              if e["type"] == "model_step_completed"}
    out += [f"model step {step} of {turn} never completed" for turn, step in sorted(steps)]
    blocks = [e["payload"]["block"] for e in replay if e["type"] == "frontend_render"]
    done = {b["id"] for b in blocks if b["state"] == "complete"}
    out += [f"notice {b['id']} ({b['title']}) never completed" for b in blocks
            if b["id"] not in done and b["state"] == "pending"]
    calls = {e["payload"]["call_id"] for e in replay if e["type"] == "tool_call_begin"}
    calls -= {e["payload"]["call_id"] for e in replay if e["type"] == "tool_call_end"}
    out += [f"tool call {c} never ended" for c in sorted(calls)]
    return out


def _marker(begin: dict[str, Any] | None) -> str | None:
    if begin is None:
        return None
    command = str(begin["payload"].get("arguments", {}).get("command", ""))
    if "effects.log" not in command:
        return None
    return command.split()[1]  # "echo m-N >> effects.log; ..."
