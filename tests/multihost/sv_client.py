"""A supervisor client run on another host (``ip netns exec``) by the multi-host
tests: ``python -m tests.multihost.sv_client ENDPOINT SERVER_KEY KEY CMD ARGS``.

Commands (one JSON line on stdout each):
- ``turns WS1 [WS2 ...]``: one session per workspace, one turn each, all at
  once → ``{"sessions": [...], "ends": [...], "tool_outcomes": [[...], ...]}``
- ``turn SID [SID ...]``: one more turn in each, all at once → ``{"results": [...]}``
- ``status``: the hosts of the broker's workers → ``{"hosts", "worker_count", "lines"}``
- ``read SID``: describe + history → ``{"ok": bool, "kinds": [...]}``
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from broker.security import CurveClient
from supervisor.cli.remote import render_hosts
from supervisor.client import SupervisorClient, SupervisorError


async def _turn(sv: SupervisorClient, sid: str) -> dict[str, Any]:
    page = await sv.history(sid, limit=5000)
    last = max((e["sequence"] for e in page["events"]), default=0)
    sub = await sv.submit(sid, {"type": "user_input", "text": "note the host"})
    outcomes: list[str] = []
    async with asyncio.timeout(90):
        async for e in sv.events(sid, after_sequence=last):
            if e["type"] == "tool_call_end":
                outcomes.append(str(e["payload"].get("outcome")))
            if e.get("submission_id") == sub and e["type"] in ("turn_complete", "turn_aborted"):
                return {"session": sid, "end": e["type"], "tool_outcomes": outcomes}
    raise RuntimeError("event stream ended")


async def main(argv: list[str]) -> dict[str, Any]:
    endpoint, server_key, key, cmd, *rest = argv
    curve = CurveClient.from_files(Path(server_key), Path(key))
    async with SupervisorClient(endpoint, curve=curve, timeout_s=15.0) as sv:
        if cmd == "turns":
            sids = [await sv.create_session(workspace=ws) for ws in rest]
            results = await asyncio.gather(*(_turn(sv, sid) for sid in sids))
            return {"results": list(results)}
        if cmd == "turn":
            return {"results": list(await asyncio.gather(*(_turn(sv, sid) for sid in rest)))}
        if cmd == "status":
            broker = (await sv.call("status"))["broker"]
            hosts = sorted({str((w.get("info") or {}).get("host"))
                            for svc in broker.get("workers", {}).values()
                            for w in svc.get("workers", [])})
            return {"hosts": hosts, "worker_count": broker.get("worker_count"),
                    "expiries": broker.get("counters", {}).get("worker_expiries"),
                    "lines": render_hosts(broker)}
        if cmd == "read":
            kinds = []
            for call in ("describe", "history"):
                try:
                    await sv.call(call, session_id=rest[0])
                    kinds.append("ok")
                except SupervisorError as exc:
                    kinds.append(exc.kind)
            return {"kinds": kinds}
    raise SystemExit(f"unknown command {cmd}")


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1:]))), flush=True)
