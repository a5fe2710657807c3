"""``python -m sandbox_worker.fakellm --script FILE [--port 0] [--host 127.0.0.1]``

Prints one JSON ready line on stdout (``{"event": "ready", "url", "pid"}``)
once listening, then serves until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

from broker.lifeline import watch_parent
from sandbox_worker.fakellm.script import ScriptError, load_script
from sandbox_worker.fakellm.server import DEFAULT_MAX_RECORDED, FakeLLM


async def _serve(ns: argparse.Namespace) -> int:
    try:
        script = load_script(Path(ns.script))
    except ScriptError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    server = FakeLLM(script, max_recorded=ns.max_recorded)
    url = await server.start(ns.host, ns.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    sys.stdout.write(json.dumps({"event": "ready", "url": url, "pid": os.getpid(),
                                 "responses": len(script.responses)}) + "\n")
    sys.stdout.flush()
    try:
        await stop.wait()
    finally:
        await server.aclose()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sandbox_worker.fakellm",
                                     description="Scripted LLM provider (OpenAI Responses, "
                                     "Chat Completions and Anthropic Messages wire formats).")
    parser.add_argument("--script", required=True, help="script JSON file")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (default)")
    parser.add_argument("--max-recorded", type=int, default=DEFAULT_MAX_RECORDED,
                        help="request bodies kept for GET /_corral/requests")
    parser.add_argument("--log-level", default="WARNING")
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    watch_parent()  # exit if the farm's root dies without stopping us
    return asyncio.run(_serve(ns))


if __name__ == "__main__":
    sys.exit(main())
