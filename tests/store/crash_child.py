"""A child process that commits steps of several sessions in a loop until it is killed.

Usage: python -m tests.store.crash_child DB_PATH SESSIONS
It resumes each session from what is durable (``Store.load``), so repeated kills also
test recovery. Prints "ready" once its first commit returned.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from supervisor.store import CheckpointState, SessionId, Store
from tests.store.steps import Session, execution, new_record, tool_round


async def run_session(store: Store, name: str, ready: asyncio.Event) -> None:
    s = Session(name)
    loaded = await store.load(SessionId(name))
    if loaded is None:
        await store.create_session(new_record(name))
    else:
        s.state = CheckpointState.from_json(loaded.state.to_json())
    while True:
        n = s.state.next_batch_sequence
        if n % 7 == 0:  # now and then a compaction: a rewrite in the same step
            rewrite = ([{"type": "compaction", "summary": f"up to {n - 1}"}], ["compaction"])
        else:
            rewrite = None
        step = s.step(
            tool_round(n, output_bytes=300 + (n * 37) % 1500),
            events=[("tool_call_end", {"n": n}), ("turn_complete", {"n": n})],
            rewrite=rewrite,
            execution=execution(name, f"turn-{n}", "completed", tool_calls=1),
            extra={"last_batch": n, "last_event": s.state.next_event_sequence + 1},
        )
        await store.commit(step)
        ready.set()


async def main() -> None:
    path, sessions = Path(sys.argv[1]), int(sys.argv[2])
    store = await Store.open(path)
    ready = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        for i in range(sessions):
            tg.create_task(run_session(store, f"crash-{i}", ready))
        await ready.wait()
        print("ready", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
