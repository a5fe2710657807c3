"""Implementations of the ``corral`` commands (the parser is in ``cli.py``).

Each ``cmd_NAME(ns) -> int`` returns the process exit code. Commands that
talk to a farm find it through ``HOME/farm.json``; without one they say how
to start it (``corral up``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

from supervisor import config as config_mod
from supervisor.cli import EXIT_FAILED, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, VERSION
from supervisor.cli_output import print_json as _print_json
from supervisor.cli_output import say_error
from supervisor.cli_remote import cmd_keys, cmd_worker, render_hosts  # noqa: F401 (commands)
from supervisor.cli_render import clean
from supervisor.cli_sessions import (  # noqa: F401 (commands)
    cmd_delete,
    cmd_sessions,
    cmd_show,
    cmd_terminate,
)
from supervisor.client import SupervisorClient, SupervisorError
from supervisor.config import ConfigError
from supervisor.farm.layout import FarmPaths
from supervisor.farm.root import Farm, running_farm, serve_forever, start_detached, stop_detached


def ensure_config(home: Path, say: Any) -> Path:
    """Write HOME/corral.toml on first use and say which route it chose."""
    path, chosen = config_mod.write_default(home)
    if chosen is not None:
        say(f"wrote {path}: [routes.main] is {chosen}; edit it to change models")
    return path


def _stderr(msg: str) -> None:
    print(f"corral: {clean(msg)}", file=sys.stderr)


def cmd_init(ns: Namespace) -> int:
    try:
        path, chosen = config_mod.write_default(ns.home)
    except OSError as exc:
        return say_error(ns, "usage", f"cannot write {ns.home / 'corral.toml'}: "
                         f"{exc.strerror}; choose another --home", EXIT_USAGE)
    if ns.json:
        _print_json({"ok": True, "config": str(path), "written": chosen is not None,
                     "route": chosen})
    elif chosen is None:
        print(f"{path} exists; left as it is (delete it to start over)")
    else:
        print(f"wrote {path}: [routes.main] is {chosen}.\n"
              f"Try: corral run --home {ns.home} --workspace DIR \"list the files\"")
    return EXIT_OK


def cmd_completion(ns: Namespace) -> int:
    from supervisor.cli import build_parser
    from supervisor.cli_completion import script

    sys.stdout.write(script(ns.shell, build_parser(), VERSION))
    return EXIT_OK


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
        ensure_config(ns.home, _stderr if not ns.json else lambda _m: None)
        config_mod.load(ns.home)  # a bad config is said here, before detaching
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
        return say_error(ns, "config", str(exc), EXIT_USAGE)
    except OSError as exc:
        return say_error(ns, "usage", f"cannot use {ns.home}: {exc}", EXIT_USAGE)
    except RuntimeError as exc:
        return say_error(ns, "start_failed", str(exc), EXIT_FAILED)
    print(f"farm at {ns.home}: starting {len(farm.specs)} processes; Ctrl-C stops it",
          file=sys.stderr)
    return asyncio.run(serve_forever(farm))


def cmd_down(ns: Namespace) -> int:
    if not running_farm(ns.home):
        # An idempotent stop: nothing runs, so there is nothing to do.
        if ns.json:
            _print_json({"ok": True, "killed_after_timeout": [], "was_running": False})
        else:
            print(f"no farm running at {ns.home}; nothing to stop")
        return EXIT_OK
    info = running_farm(ns.home) or {}
    if info.get("temporary"):
        return say_error(ns, "usage", f"the farm at {ns.home} is the temporary farm of a "
                         f"'corral run' (pid {info.get('root_pid')}); it stops "
                         "when that run ends: interrupt it with Ctrl-C there, or "
                         "corral interrupt SESSION", EXIT_USAGE)
    killed = stop_detached(ns.home)
    if ns.json:
        _print_json({"ok": True, "killed_after_timeout": killed})
    else:
        print("farm stopped" + (f"; had to kill {killed}" if killed else " cleanly"))
    return EXIT_OK


def _print_farm(info: dict[str, Any]) -> None:
    kind = " (temporary: the farm of one corral run)" if info.get("temporary") else ""
    print(f"farm {info.get('state')} at {info.get('home')} (root pid {info.get('root_pid')})"
          f"{kind}")
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
        print(f"supervisor: {clean(str(sup['error']))}")
        return EXIT_OK
    broker = sup.get("broker", {})
    queues = broker.get("queues", {})
    for service, w in sorted(broker.get("workers", {}).items()):
        print(f"  service {service:<8} workers idle {w.get('idle', 0)} busy {w.get('busy', 0)} "
              f"queued {queues.get(service, 0)}")
    for line in render_hosts(broker):
        print(clean(line))  # host names and identities come from remote workers
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
            print(f"corral: {clean(exc.message)} ({clean(exc.kind)})", file=sys.stderr)
        return EXIT_FAILED, None


def _submit(ns: Namespace, op: dict[str, Any]) -> int:
    code, result = _with_farm(ns, "submit", session_id=ns.session, op=op)
    if code == EXIT_OK:
        if ns.json:
            _print_json({"ok": True, "submission_id": result})
        else:
            print(f"submitted ({result})")
    return code


def cmd_approve(ns: Namespace) -> int:
    code, described = _with_farm(ns, "describe", session_id=ns.session)
    if code != EXIT_OK:
        return code
    pending = (described or {}).get("pending_approval") or {}
    if pending.get("id") != ns.id:
        now = (f"it waits on {pending.get('id')}" if pending.get("id")
               else "it waits on no approval")
        return say_error(ns, "unknown_approval", f"approval {ns.id!r} is not pending in "
                         f"session {ns.session} ({now}); see it with: corral show "
                         f"{ns.session}", EXIT_FAILED)
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
            print(f"  - {clean(p)}", file=sys.stderr)  # text from an untrusted file
    else:
        print(f"{ns.file}: ok")
    return EXIT_OK if not problems else EXIT_FAILED


def cmd_import(ns: Namespace) -> int:
    from supervisor.cli_run import import_checkpoint

    return import_checkpoint(ns)


# -- tools --------------------------------------------------------------------


def cmd_fake_llm(ns: Namespace) -> int:
    """Become the scripted provider (exec): ``kill PID`` then reaches the server
    itself, and nothing is left behind."""
    argv = [sys.executable, "-m", "sandbox_worker.fakellm", "--script", str(ns.script),
            "--port", str(ns.port), "--host", ns.host]
    env = {k: v for k, v in os.environ.items() if k != "CORRAL_PARENT_PID"}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, env)  # never returns


def cmd_chaos(ns: Namespace) -> int:
    from supervisor.chaos import main as chaos_main

    return chaos_main(ns)
