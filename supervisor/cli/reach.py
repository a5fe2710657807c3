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


def no_farm(home: Path, as_json: bool) -> int:
    """Say that no farm runs at ``home`` and how to start one; returns exit code 3."""
    msg = f"no farm is running at {home}; start one with: corral up --home {home} --detach"
    if as_json:
        print_json({"ok": False, "error": {"kind": "unavailable", "message": msg}})
    else:
        print(f"corral: {msg}", file=sys.stderr)
    return EXIT_UNAVAILABLE


async def supervisor_call(home: Path, call: str, **args: Any) -> Any:
    """One call to the supervisor of the farm at ``home``."""
    from supervisor.client import SupervisorClient
    from supervisor.farm.layout import FarmPaths

    async with SupervisorClient(FarmPaths.of(home).supervisor_endpoint) as sv:
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
