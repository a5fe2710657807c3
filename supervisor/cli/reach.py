"""Reaching the running farm's supervisor from a command.

Commands that talk to a farm find it through ``HOME/farm.json``; without one
they say how to start it (``corral up``) and exit 3. A supervisor's refusal is
printed as ``corral: MESSAGE (KIND)`` (or the JSON error document) and exits 1.

The farm and client modules are imported when a call is made, not with the
parser (``corral --help`` stays light).
"""

from __future__ import annotations

import asyncio
import sys
from argparse import Namespace
from pathlib import Path
from typing import Any

from supervisor.cli.common import EXIT_FAILED, EXIT_OK, EXIT_UNAVAILABLE
from supervisor.cli.output import print_json
from supervisor.cli.render import clean

# How long a supervisor of a farm of several has to answer a command's first hello
# before the next one is asked (twice: the client's own hello, then this one).
PROBE_S = 1.5


def no_farm(home: Path, as_json: bool) -> int:
    """Say that no farm runs at ``home`` and how to start one; returns exit code 3."""
    msg = f"no farm is running at {home}; start one with: corral up --home {home} --detach"
    if as_json:
        print_json({"ok": False, "error": {"kind": "unavailable", "message": msg}})
    else:
        print(f"corral: {msg}", file=sys.stderr)
    return EXIT_UNAVAILABLE


def farm_endpoints(home: Path) -> list[str]:
    """The client endpoints of the farm's supervisors (farm.json), the first first."""
    from supervisor.farm.layout import FarmPaths, read_farm_json

    paths = FarmPaths.of(home)
    info = read_farm_json(paths) or {}
    listed = info.get("endpoints", {}).get("supervisors") if isinstance(
        info.get("endpoints"), dict) else None
    if isinstance(listed, list) and listed and all(isinstance(e, str) for e in listed):
        return list(listed)
    return [paths.supervisor_endpoint]


async def _answers(endpoint: str, probe_s: float) -> bool:
    from supervisor.client import SupervisorClient, SupervisorError

    try:
        async with SupervisorClient(endpoint, timeout_s=probe_s) as sv:
            await sv.call("hello", timeout_s=probe_s)
    except SupervisorError:
        return False
    return True


async def live_endpoint(home: Path, probe_s: float = PROBE_S) -> str:
    """The endpoint a command talks to: the first supervisor's; in a farm of several
    (they share the sessions, and any of them serves any request, redirecting it to
    the session's owner) the first one that answers ``hello`` within ``probe_s`` (a
    supervisor paused, hung or being restarted is skipped). The first when none does
    (the command's own call then reports it)."""
    endpoints = farm_endpoints(home)
    if len(endpoints) == 1:
        return endpoints[0]
    for n, endpoint in enumerate(endpoints):
        if await _answers(endpoint, probe_s):
            if n:
                print(f"corral: supervisor 1 ({endpoints[0]}) did not answer within "
                      f"{probe_s:g}s; asking supervisor {n + 1} ({endpoint})",
                      file=sys.stderr)
            return endpoint
    return endpoints[0]


async def supervisor_call(home: Path, call: str, **args: Any) -> Any:
    """One call to a supervisor of the farm at ``home`` (``live_endpoint``)."""
    from supervisor.client import SupervisorClient

    async with SupervisorClient(await live_endpoint(home)) as sv:
        return await sv.call(call, **args)


def with_farm(ns: Namespace, call: str, **args: Any) -> tuple[int, Any]:
    """``(EXIT_OK, result)`` of one call to the running farm, or ``(code, None)``
    once the problem has been said."""
    from supervisor.client import SupervisorError
    from supervisor.farm.root import running_farm

    if running_farm(ns.home) is None:
        return no_farm(ns.home, ns.json), None
    try:
        return EXIT_OK, asyncio.run(supervisor_call(ns.home, call, **args))
    except SupervisorError as exc:
        if ns.json:
            print_json({"ok": False, "error": {"kind": exc.kind, "message": exc.message}})
        else:
            print(f"corral: {clean(exc.message)} ({clean(exc.kind)})", file=sys.stderr)
        return EXIT_FAILED, None
