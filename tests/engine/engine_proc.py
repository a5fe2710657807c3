"""A supervisor engine in its own process, for kill tests.

``python -m tests.engine.engine_proc --db PATH --frontend EP --llm-url URL
--workspace DIR --text TEXT`` opens the store, runs a ``SessionManager``,
creates one session (approval "allow"), submits TEXT, prints a JSON ready line
``{"event": "ready", "session_id"}`` and then one JSON line per event
``{"type", "sequence"}``, until it is killed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from broker.client import BrokerClient
from sandbox_worker.api import ModelRoute
from supervisor.engine import EngineConfig, SessionManager, SessionSpec
from supervisor.store import Store


async def main(ns: argparse.Namespace) -> None:
    route = ModelRoute(name="main", provider="openai-responses", model="scripted",
                       base_url=ns.llm_url, max_retries=0)
    store = await Store.open(Path(ns.db))
    async with BrokerClient(ns.frontend) as client:
        manager = SessionManager(store=store, broker=client,
                                 config=EngineConfig(routes={"main": route}))
        async with asyncio.TaskGroup() as tg:
            tg.create_task(manager.run())
            await manager.started()
            sid = await manager.create_session(SessionSpec(workspace=ns.workspace,
                                                           approval="allow"))
            it = manager.subscribe(sid)
            await manager.submit(sid, {"type": "user_input", "text": ns.text})
            print(json.dumps({"event": "ready", "session_id": sid}), flush=True)
            async for e in it:
                print(json.dumps({"type": e.type, "sequence": e.sequence}), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for flag in ("--db", "--frontend", "--llm-url", "--workspace", "--text"):
        parser.add_argument(flag, required=True)
    asyncio.run(main(parser.parse_args()))
    sys.exit(0)
