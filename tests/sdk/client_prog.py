"""A client program for the disconnect test: ``python -m tests.sdk.client_prog
ENDPOINT WORKSPACE MARKER``. It creates a session holding a client tool
``probe`` (``client_wait_s`` 1 s), prints the session id, and runs a turn;
``probe`` writes MARKER (this pid) and then blocks until the process is killed."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from pathlib import Path

from supervisor.sdk import Corral, SessionOptions, tool


async def main(endpoint: str, workspace: str, marker: str) -> None:
    @tool
    def probe(x: int) -> str:
        Path(marker).write_text(str(os.getpid()))
        threading.Event().wait()  # runs until the test kills this program
        return "never"

    async with Corral(endpoint) as corral:
        session = await corral.create_session(SessionOptions(
            workspace=workspace, approval="allow", client_wait_s=1.0), tools=[probe])
        print(session.id, flush=True)
        async for _event in session.run("go"):
            pass


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
