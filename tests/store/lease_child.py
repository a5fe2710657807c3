"""A child process that holds a session's lease on PostgreSQL and commits steps until its
lease is lost (a supervisor's writer, cut down to the store).

Usage: python -m tests.store.lease_child URL SESSION LEASE_S
Prints one JSON line per event: {"committed": seq} after each committed step (its
event sequence), {"lost": [...]} when a renewal finds leases gone, {"refused": seq}
when a write is refused (then it exits 0: the session is given up, nothing more is
written). A broken connection (the server ended its session while it was paused) is
retried with the same step, as the engine retries a store error.
"""

from __future__ import annotations

import asyncio
import json
import sys

from supervisor.store import LeaseLost, StoreError
from supervisor.store.pg.store import PgStore
from tests.store.steps import Session, new_record, tool_round


def say(**what: object) -> None:
    print(json.dumps(what), flush=True)


async def renew_forever(store: PgStore, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        try:
            lost = await store.renew()
        except StoreError:
            continue
        if lost:
            say(lost=lost)


async def main(url: str, name: str, lease_s: float) -> None:
    store = await PgStore.open(url, owner="child", lease_s=lease_s)
    try:
        s = Session(name)
        await store.create_session(new_record(name))
        async with asyncio.TaskGroup() as tg:
            renewer = tg.create_task(renew_forever(store, lease_s / 4))
            while True:
                seq = s.state.next_event_sequence
                step = s.step(tool_round(seq), events=[("step", {"by": "child", "n": seq})])
                while True:
                    try:
                        await store.commit(step)
                        break
                    except LeaseLost:
                        say(refused=seq)
                        renewer.cancel()
                        return
                    except StoreError:
                        await asyncio.sleep(0.05)  # unavailable/busy: the same step again
                say(committed=seq)
                await asyncio.sleep(0.05)
    finally:
        await store.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
    sys.exit(0)
