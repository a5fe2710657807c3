"""SIGKILL a process that commits in a loop, at arbitrary instants, then reopen: the
database is consistent (integrity ok, dense sequences, state row matching the last
committed batch and event, context matching the rewrite + batches)."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
from contextlib import closing
from functools import partial
from pathlib import Path

import pytest

from supervisor.store import SessionId, Store
from supervisor.store.schema import KEY_BITS
from tests.helpers import Procs, read_line_with_deadline, wait_until

SESSIONS = 4


def _batches(path: Path) -> int:
    with closing(sqlite3.connect(path, timeout=5)) as raw:
        return int(raw.execute("SELECT count(*) FROM transcript_batches").fetchone()[0])


def _at_least(path: Path, target: int) -> bool:
    return _batches(path) >= target


def _check_invariants(path: Path) -> dict[str, int]:
    """Raw-SQL checks of every session; returns session -> last batch."""
    last: dict[str, int] = {}
    with closing(sqlite3.connect(path)) as raw:
        assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        for sid, name in raw.execute("SELECT sid, session_id FROM sessions").fetchall():
            lo, hi = sid << KEY_BITS, ((sid + 1) << KEY_BITS) - 1
            events = [r[0] for r in raw.execute(
                "SELECT sequence FROM events WHERE k BETWEEN ? AND ? ORDER BY k", (lo, hi))]
            batches = [r[0] for r in raw.execute(
                "SELECT sequence FROM transcript_batches WHERE k BETWEEN ? AND ? ORDER BY k",
                (lo, hi))]
            assert events == list(range(1, len(events) + 1)), f"{name}: events not dense"
            assert batches == list(range(1, len(batches) + 1)), f"{name}: batches not dense"
            row = raw.execute("SELECT next_event_sequence, next_batch_sequence FROM "
                              "checkpoint_state WHERE sid = ?", (sid,)).fetchone()
            assert row == (len(events) + 1, len(batches) + 1), f"{name}: state vs journal"
            turns = raw.execute("SELECT count(*) FROM executions WHERE sid = ?",
                                (sid,)).fetchone()[0]
            assert turns == len(batches), f"{name}: one execution per committed step"
            last[name] = len(batches)
    return last


async def _check_loaded(path: Path, last: dict[str, int]) -> None:
    store = await Store.open(path)
    try:
        for name, last_batch in last.items():
            loaded = await store.load(SessionId(name))
            assert loaded is not None
            assert loaded.last_batch_sequence == last_batch
            assert loaded.state.extra.get("last_batch", 0) == last_batch
            assert loaded.state.extra.get("last_event", 0) == loaded.last_event_sequence
            # Context = the newest compaction summary + the rounds after it.
            if last_batch >= 7:
                assert loaded.context[0]["type"] == "compaction"
            rounds = [i["call_id"] for i in loaded.context if i["type"] == "function_call"]
            assert rounds == [f"call-{n}" for n in range(last_batch - len(rounds) + 1,
                                                         last_batch + 1)]
    finally:
        await store.close()


@pytest.mark.timeout(120)
async def test_sigkill_while_committing_leaves_a_consistent_database(
    tmp_path: Path, procs: Procs
) -> None:
    path = tmp_path / "crash.db"
    rng = random.Random(os.getpid())
    total = 0
    for round_ in range(10):
        child = procs.python("tests.store.crash_child", str(path), str(SESSIONS),
                             name=f"crash-child-{round_}", stdout=subprocess.PIPE)
        assert read_line_with_deadline(child, 60) == "ready"
        target = total + rng.randint(5, 120)
        wait_until(partial(_at_least, path, target), timeout_s=60,
                   what=f"{target} batches committed")
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=10) == -signal.SIGKILL
        assert child.stdout is not None
        child.stdout.close()
        last = _check_invariants(path)
        total = sum(last.values())
        assert total >= target
        await _check_loaded(path, last)
