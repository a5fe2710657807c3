"""Builders of realistic engine steps for the store tests (and the crash child)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from supervisor.store import (
    CheckpointState,
    ContextRewrite,
    EventRecord,
    ExecutionRecord,
    SessionId,
    SessionRecord,
    StepWrite,
    Store,
    TranscriptBatch,
    TurnId,
)


def new_record(session_id: str, **config: Any) -> SessionRecord:
    return SessionRecord(SessionId(session_id), time.time(),
                         {"route": "main", "workspace": "/tmp/ws", **config})


class Session:
    """Tracks the engine-side counters of one session and builds its next steps."""

    def __init__(self, session_id: str) -> None:
        self.id = SessionId(session_id)
        self.state = CheckpointState(route="main")
        self.context_len = 0

    def step(
        self,
        items: list[dict[str, Any]] | None = None,
        *,
        events: list[tuple[str, dict[str, Any]]] | None = None,
        rewrite: tuple[list[dict[str, Any]], list[str]] | None = None,
        execution: ExecutionRecord | None = None,
        extra: dict[str, Any] | None = None,
    ) -> StepWrite:
        """The next step: events get the next sequences, items become the next batch."""
        evs = []
        for typ, payload in events or []:
            evs.append(EventRecord(self.id, self.state.next_event_sequence, typ, payload))
            self.state.next_event_sequence += 1
        rw = None
        if rewrite is not None:
            self.state.context_epoch += 1
            rw = ContextRewrite(self.state.context_epoch, rewrite[0], rewrite[1],
                                at_batch=self.state.next_batch_sequence - 1)
            self.state.last_rewrite = {"epoch": rw.epoch, "reasons": rw.reasons,
                                       "at_batch": rw.at_batch}
            if "compaction" in rewrite[1]:
                self.state.compaction_count += 1
        batch = None
        if items is not None:
            batch = TranscriptBatch(self.id, self.state.next_batch_sequence,
                                    self.state.context_epoch, items)
            self.state.next_batch_sequence += 1
        if extra is not None:
            self.state.extra = dict(extra)
        return StepWrite(self.id, events=evs, append_batch=batch, rewrite=rw,
                         state=CheckpointState.from_json(self.state.to_json()),
                         execution=execution)


def tool_round(n: int, output_bytes: int = 1500) -> list[dict[str, Any]]:
    """One model+tool round: a user message, a function_call, its output, a reply."""
    return [
        {"type": "message", "role": "user", "content": [{"type": "input_text",
                                                          "text": f"please do step {n}"}]},
        {"type": "function_call", "call_id": f"call-{n}", "name": "shell",
         "arguments": '{"command": "cat notes.txt"}'},
        {"type": "function_call_output", "call_id": f"call-{n}",
         "output": (f"line {n} " * (output_bytes // 7 + 1))[:output_bytes]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text",
                                                               "text": f"done with {n}"}]},
    ]


def execution(session_id: str, turn: str, outcome: str, **kw: Any) -> ExecutionRecord:
    fields: dict[str, Any] = {
        "model_calls": 1, "tool_calls": 0, "failed_tool_calls": 0,
        "usage": {"input": 1, "cached_input": 0, "cache_write_input": 0, "output": 1,
                  "reasoning_output": 0, "total": 2},
        "started_at": time.time(),
    }
    fields.update(kw)
    return ExecutionRecord(SessionId(session_id), TurnId(turn), outcome, **fields)


async def open_store(path: Path, **kw: Any) -> Store:
    return await Store.open(path, **kw)
