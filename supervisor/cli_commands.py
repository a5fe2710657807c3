"""Implementations of the ``corral`` commands (the parser is in ``cli.py``).

Each ``cmd_NAME(ns) -> int`` returns the process exit code. Commands that
talk to a farm find it through ``HOME/farm.json``; without one they say how
to start it (``corral up``).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

from supervisor.cli import EXIT_FAILED, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE
from supervisor.cli_remote import cmd_keys, cmd_worker, render_hosts  # noqa: F401 (commands)
from supervisor.client import SupervisorClient, SupervisorError
from supervisor.config import ConfigError
from supervisor.farm.layout import FarmPaths
from supervisor.farm.root import Farm, running_farm, serve_forever, start_detached, stop_detached


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


def _no_farm(home: Path, as_json: bool) -> int:
    msg = f"no farm is running at {home}; start one with: corral up --home {home} --detach"
    if as_json:
        _print_json({"ok": False, "error": {"kind": "unavailable", "message": msg}})
    else:
        print(f"corral: {msg}", file=sys.stderr)
    return EXIT_UNAVAILABLE


# -- farm lifecycle ---------------------------------------------------------


def cmd_up(ns: Namespace) -> int:
    if running_farm(ns.home):
        print(f"corral: a farm is already running at {ns.home} (corral status)",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        if ns.detach:
            if not ns.json:
                print(f"starting a farm at {ns.home} ...", file=sys.stderr)
            info = start_detached(ns.home, workers=ns.workers)
            if ns.json:
                _print_json(info)
            else:
                _print_farm(info)
            return EXIT_OK
        farm = Farm(ns.home, workers=ns.workers)
    except ConfigError as exc:
        print(f"corral: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RuntimeError as exc:
        print(f"corral: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(f"farm at {ns.home}: starting {len(farm.specs)} processes; Ctrl-C stops it",
          file=sys.stderr)
    return asyncio.run(serve_forever(farm))


def cmd_down(ns: Namespace) -> int:
    if not running_farm(ns.home):
        return _no_farm(ns.home, ns.json)
    killed = stop_detached(ns.home)
    if ns.json:
        _print_json({"ok": True, "killed_after_timeout": killed})
    else:
        print("farm stopped" + (f"; had to kill {killed}" if killed else " cleanly"))
    return EXIT_OK


def _print_farm(info: dict[str, Any]) -> None:
    print(f"farm {info.get('state')} at {info.get('home')} (root pid {info.get('root_pid')})")
    for child in info.get("children", []):
        print(f"  {child['name']:<16} pid {child['pid']!s:<8} {child['state']:<10} "
              f"restarts {child['restarts']}")


def cmd_status(ns: Namespace) -> int:
    info = running_farm(ns.home)
    if info is None:
        return _no_farm(ns.home, ns.json)
    status: dict[str, Any] = {"farm": info}
    try:
        status["supervisor"] = asyncio.run(_supervisor_call(ns.home, "status"))
    except SupervisorError as exc:
        status["supervisor"] = {"error": str(exc)}
    if ns.json:
        _print_json(status)
        return EXIT_OK
    _print_farm(info)
    sup = status["supervisor"]
    if "error" in sup:
        print(f"supervisor: {sup['error']}")
        return EXIT_OK
    broker = sup.get("broker", {})
    queues = broker.get("queues", {})
    for service, w in sorted(broker.get("workers", {}).items()):
        print(f"  service {service:<8} workers idle {w.get('idle', 0)} busy {w.get('busy', 0)} "
              f"queued {queues.get(service, 0)}")
    for line in render_hosts(broker):
        print(line)
    sessions = dict(sup.get("sessions", {}))
    lag, lag_max = sessions.pop("loop_lag_s", None), sessions.pop("loop_lag_max_60s_s", None)
    if sessions:
        print("  sessions " + ", ".join(f"{k} {v}" for k, v in sorted(sessions.items())))
    if lag is not None:
        print(f"  supervisor loop lag {lag:.3f}s (worst in the last minute {lag_max:.3f}s)")
    for r in info.get("restarts", [])[-5:]:
        print(f"  restart: {r['child']} ({r['why']}) at {time.ctime(r['at'])}")
    return EXIT_OK


async def _supervisor_call(home: Path, call: str, **args: Any) -> Any:
    async with SupervisorClient(FarmPaths.of(home).supervisor_endpoint) as sv:
        return await sv.call(call, **args)


# -- sessions -----------------------------------------------------------------


def _with_farm(ns: Namespace, call: str, **args: Any) -> tuple[int, Any]:
    if running_farm(ns.home) is None:
        return _no_farm(ns.home, ns.json), None
    try:
        return EXIT_OK, asyncio.run(_supervisor_call(ns.home, call, **args))
    except SupervisorError as exc:
        if ns.json:
            _print_json({"ok": False, "error": {"kind": exc.kind, "message": exc.message}})
        else:
            print(f"corral: {exc.message} ({exc.kind})", file=sys.stderr)
        return EXIT_FAILED, None


def cmd_sessions(ns: Namespace) -> int:
    code, result = _with_farm(ns, "list_sessions", limit=ns.limit)
    if code != EXIT_OK:
        return code
    if ns.json:
        _print_json(result)
        return EXIT_OK
    for s in result.get("sessions", []):
        print(f"{s['session_id']}  {s.get('status', ''):<8} route {s.get('route', '')}  "
              f"{s.get('workspace', '')}")
    return EXIT_OK


def cmd_show(ns: Namespace) -> int:
    code, result = _with_farm(ns, "history", session_id=ns.session, after_sequence=0,
                              limit=5000)
    if code != EXIT_OK:
        return code
    if ns.json:
        _print_json(result)
        return EXIT_OK
    from supervisor.cli_render import Renderer

    renderer = Renderer(sys.stdout)
    for event in result.get("events", []):
        renderer.render(event)
    return EXIT_OK


def _submit(ns: Namespace, op: dict[str, Any]) -> int:
    code, result = _with_farm(ns, "submit", session_id=ns.session, op=op)
    if code == EXIT_OK:
        if ns.json:
            _print_json({"ok": True, "submission_id": result})
        else:
            print(f"submitted ({result})")
    return code


def cmd_approve(ns: Namespace) -> int:
    return _submit(ns, {"type": "exec_approval", "id": ns.id, "decision": ns.decision})


def cmd_interrupt(ns: Namespace) -> int:
    code, described = _with_farm(ns, "describe", session_id=ns.session)
    if code != EXIT_OK:
        return code
    turn = (described or {}).get("active_turn") or {}
    if not turn.get("turn_id"):
        msg = f"session {ns.session} has no active turn to interrupt"
        print(f"corral: {msg}", file=sys.stderr) if not ns.json else _print_json(
            {"ok": False, "error": {"kind": "bad_op", "message": msg}})
        return EXIT_FAILED
    return _submit(ns, {"type": "interrupt", "turn_id": turn["turn_id"]})


def cmd_run(ns: Namespace) -> int:
    from supervisor.cli_run import run_turn

    return run_turn(ns)


# -- checkpoints --------------------------------------------------------------


def cmd_export(ns: Namespace) -> int:
    code, result = _with_farm(ns, "export", session_id=ns.session)
    if code != EXIT_OK:
        return code
    doc = result["checkpoint"]
    out: Path = ns.out
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        tmp.write_text(json.dumps(doc, sort_keys=True, ensure_ascii=False) + "\n")
        os.replace(tmp, out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        print(f"corral: cannot write {out}: {exc.strerror}; choose another --out",
              file=sys.stderr)
        return EXIT_FAILED
    descriptor = doc["descriptor"]
    if ns.json:
        _print_json({"ok": True, "path": str(out), "digest": descriptor["digest"],
                     "run_id": descriptor["run_id"], "turn": descriptor["turn"],
                     "source": result.get("source")})
    else:
        print(f"wrote {out} (run {descriptor['run_id']}, tool round {descriptor['turn']}, "
              f"{descriptor['digest']}); check it with: corral verify {out}")
    return EXIT_OK


def cmd_verify(ns: Namespace) -> int:
    from supervisor.export import verify

    try:
        doc = json.loads(ns.file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        problems = [f"cannot read {ns.file}: {exc}"]
    else:
        problems = verify(doc)
    if ns.json:
        _print_json({"ok": not problems, "problems": problems, "file": str(ns.file)})
    elif problems:
        print(f"{ns.file}: FAILED", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
    else:
        print(f"{ns.file}: ok")
    return EXIT_OK if not problems else EXIT_FAILED


def cmd_import(ns: Namespace) -> int:
    from supervisor.cli_run import import_checkpoint

    return import_checkpoint(ns)


# -- tools --------------------------------------------------------------------


def cmd_fake_llm(ns: Namespace) -> int:
    argv = [sys.executable, "-m", "sandbox_worker.fakellm", "--script", str(ns.script),
            "--port", str(ns.port), "--host", ns.host]
    return subprocess.call(argv)


def cmd_chaos(ns: Namespace) -> int:
    from supervisor.chaos import main as chaos_main

    return chaos_main(ns)
