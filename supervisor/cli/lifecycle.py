"""``corral init``, ``up``, ``down`` and ``status``: a farm's configuration and
lifecycle.

``up`` writes HOME/corral.toml on first use (``ensure_config``, shared with
``corral run``'s temporary farm) and says a bad configuration before it
detaches. ``down`` is idempotent: with no farm running it succeeds.

The config and farm modules are imported by the handlers, not with the parser.
"""

from __future__ import annotations

import asyncio
import sys
import time
from argparse import Namespace
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supervisor.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    Subparsers,
    add_home,
    add_json,
    workers_arg,
)
from supervisor.cli.output import print_json, say_error
from supervisor.cli.reach import no_farm, supervisor_call
from supervisor.cli.remote import render_hosts
from supervisor.cli.render import clean


def add_parsers(sub: Subparsers) -> None:
    p = sub.add_parser("init", help="write a commented corral.toml with a working model route",
                       description="Write HOME/corral.toml (commented) unless it exists. Its "
                       "[routes.main] uses a provider whose key is in the environment "
                       "(ANTHROPIC_API_KEY, OPENAI_API_KEY), else the scripted demo model. "
                       "The first 'corral up' or 'corral run' does the same.")
    add_home(p)
    add_json(p)
    p.set_defaults(handler=cmd_init)

    p = sub.add_parser("up", help="start a farm (broker, supervisor, sandbox workers)",
                       description="Start a farm. In the foreground it supervises its "
                       "children until Ctrl-C; with --detach it returns once the farm serves "
                       "and writes HOME/farm.json.")
    add_home(p)
    p.add_argument("--workers", type=workers_arg, default=None,
                   help="sandbox workers (default: config, else one per core, at least 2; "
                   "0: none here, every worker is remote)")
    p.add_argument("--brokers", type=int, default=None, choices=range(1, 5), metavar="N",
                   help="broker processes, 1..4 (default: [farm] brokers in corral.toml, 1); "
                   "with 2 the workers serve both and the supervisor moves off a lost one")
    p.add_argument("--supervisors", type=int, default=None, choices=range(1, 9), metavar="N",
                   help="supervisor processes, 1..8 (default: [farm] supervisors, 1), each "
                   "with its own client endpoint, sharing the sessions through leases; more "
                   "than 1 needs [store] url (PostgreSQL) in corral.toml")
    p.add_argument("--detach", action="store_true", help="run in the background")
    p.add_argument("--metrics", default=None, metavar="HOST:PORT", type=host_port_arg,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (default: "
                   "[telemetry] metrics_listen in corral.toml; off)")
    p.add_argument("--web", default=None, metavar="HOST:PORT", type=host_port_arg,
                   help="serve the read-only live web view at http://HOST:PORT/ (default: "
                   "[web] listen; off); an address other than loopback needs the token "
                   "printed at start")
    add_json(p)
    p.set_defaults(handler=cmd_up)

    p = sub.add_parser("down", help="stop the farm gracefully",
                       description="Stop a detached farm: sessions checkpointed, workers "
                       "drained, no process left behind. With no farm running it does "
                       "nothing and succeeds.")
    add_home(p)
    add_json(p)
    p.set_defaults(handler=cmd_down)

    p = sub.add_parser("status", help="show processes, workers, sessions and queues",
                       description="Show the running farm: its processes and restarts, "
                       "the workers of each service and host, queues and session counts.")
    add_home(p)
    add_json(p)
    p.set_defaults(handler=cmd_status)


def host_port_arg(text: str) -> str:
    """``HOST:PORT`` (``[v6]:PORT`` too), checked at parse time."""
    import argparse

    from supervisor.telemetry.setup import split_host_port

    try:
        split_host_port(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f'{exc}; e.g. "127.0.0.1:9464"') from None
    return text


def ensure_config(home: Path, say: Callable[[str], None]) -> Path:
    """Write HOME/corral.toml on first use and say which route it chose."""
    from supervisor import config as config_mod

    path, chosen = config_mod.write_default(home)
    if chosen is not None:
        say(f"wrote {path}: [routes.main] is {chosen}; edit it to change models")
    return path


def _stderr(msg: str) -> None:
    print(f"corral: {clean(msg)}", file=sys.stderr)


def cmd_init(ns: Namespace) -> int:
    from supervisor import config as config_mod

    try:
        path, chosen = config_mod.write_default(ns.home)
    except OSError as exc:
        return say_error(ns, "usage", f"cannot write {ns.home / 'corral.toml'}: "
                         f"{exc.strerror}; choose another --home", EXIT_USAGE)
    if ns.json:
        print_json({"ok": True, "config": str(path), "written": chosen is not None,
                    "route": chosen})
    elif chosen is None:
        print(f"{path} exists; left as it is (delete it to start over)")
    else:
        print(f"wrote {path}: [routes.main] is {chosen}.\n"
              f"Try: corral run --home {ns.home} --workspace DIR \"list the files\"")
    return EXIT_OK


# -- farm lifecycle ---------------------------------------------------------


def cmd_up(ns: Namespace) -> int:
    from supervisor import config as config_mod
    from supervisor.farm.root import Farm, running_farm, serve_forever, start_detached

    if running_farm(ns.home):
        return say_error(ns, "already_running", f"a farm is already running at {ns.home} "
                         f"(see it with: corral status --home {ns.home}; stop it with: "
                         f"corral down --home {ns.home})", EXIT_USAGE)
    try:
        ensure_config(ns.home, _stderr if not ns.json else lambda _m: None)
        cfg = config_mod.load(ns.home)  # a bad config is said here, before detaching
        if ns.supervisors is not None:
            config_mod.farm_supervisors(ns.home / "corral.toml", ns.supervisors, cfg.store_url)
        if ns.detach:
            if not ns.json:
                print(f"starting a farm at {ns.home} ...", file=sys.stderr)
            info = start_detached(ns.home, workers=ns.workers, metrics=ns.metrics,
                                  web=ns.web, brokers=ns.brokers,
                                  supervisors=ns.supervisors)
            if ns.json:
                print_json(info)
            else:
                _print_farm(info)
                for line in telemetry_lines(info.get("children", []), ns.home):
                    print(line)
            return EXIT_OK
        said: list[str] = []

        def say_telemetry() -> None:
            if said or not farm.serving:
                return
            said.extend(telemetry_lines(farm.tree.status(), ns.home))
            for line in said:
                print(f"corral: {line}", file=sys.stderr)

        farm = Farm(ns.home, workers=ns.workers, metrics=ns.metrics, web=ns.web,
                    on_change=say_telemetry, brokers=ns.brokers,
                    supervisors=ns.supervisors)
    except config_mod.ConfigError as exc:
        return say_error(ns, "config", str(exc), EXIT_USAGE)
    except OSError as exc:
        return say_error(ns, "usage", f"cannot use {ns.home}: {exc}", EXIT_USAGE)
    except RuntimeError as exc:
        return say_error(ns, "start_failed", str(exc), EXIT_FAILED)
    print(f"farm at {ns.home}: starting {len(farm.specs)} processes; Ctrl-C stops it",
          file=sys.stderr)
    return asyncio.run(serve_forever(farm))


def telemetry_lines(children: list[dict[str, Any]], home: Path) -> list[str]:
    """Where the supervisor serves metrics and the web view (its ready line),
    with the web view's token when its address needs one."""
    ready = next((c.get("ready") or {} for c in children if c.get("name") == "supervisor"), {})
    lines = []
    if isinstance(ready.get("metrics"), str):
        lines.append(f"metrics: {ready['metrics']}")
    web = ready.get("web")
    if isinstance(web, str):
        from supervisor.telemetry.setup import split_host_port
        from supervisor.telemetry.web import TOKEN_FILE, is_loopback

        host = split_host_port(web.rstrip("/").removeprefix("http://"))[0]
        token = ""
        if not is_loopback(host):
            try:
                token = "?token=" + (home / TOKEN_FILE).read_text().strip()
            except OSError:
                token = f" (token in {home / TOKEN_FILE})"
        lines.append(f"web view: {web}{token}")
    return lines


def cmd_down(ns: Namespace) -> int:
    from supervisor.farm.root import running_farm, stop_detached

    if not running_farm(ns.home):
        # An idempotent stop: nothing runs, so there is nothing to do.
        if ns.json:
            print_json({"ok": True, "killed_after_timeout": [], "was_running": False})
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
        print_json({"ok": True, "killed_after_timeout": killed, "was_running": True})
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
    sups = info.get("endpoints", {}).get("supervisors", [])
    for n, endpoint in enumerate(sups, start=1):  # a farm with several supervisors
        print(clean(f"  supervisor {n} endpoint {endpoint}"))


def _supervisor_lines(leases: Any) -> list[str]:
    """The supervisors sharing a PostgreSQL store, their sessions and lease ages."""
    if not isinstance(leases, dict):
        return []
    if "error" in leases:
        return [f"  supervisors: {leases['error']}"]
    me = leases.get("self")
    lines = [f"  supervisors on the shared store (lease {leases.get('lease_s')}s):"]
    for o in leases.get("owners", []):
        mark = " (this one)" if o.get("id") == me else ""
        where = f" at {o['address']}" if o.get("address") else ""
        line = f"    {o.get('id')}{mark}{where}: {o.get('sessions')} sessions"
        if o.get("expires_in_s") is not None:
            line += (f", lease renewed {o.get('renewed_s_ago')}s ago, expires in "
                     f"{o.get('expires_in_s')}s")
        if o.get("silent"):
            heard = o.get("heard_s_ago")
            line += (f"; SILENT: not heard for {heard}s (paused, cut off or dead; its "
                     "sessions go to another supervisor as their leases lapse)"
                     if heard is not None else "; never heard (no heartbeat recorded)")
        lines.append(line)
    return lines


def cmd_status(ns: Namespace) -> int:
    from supervisor.client import SupervisorError
    from supervisor.farm.root import running_farm

    info = running_farm(ns.home)
    if info is None:
        return no_farm(ns.home, ns.json)
    status: dict[str, Any] = {"farm": info}
    try:
        status["supervisor"] = asyncio.run(supervisor_call(ns.home, "status"))
    except SupervisorError as exc:
        status["supervisor"] = {"error": str(exc)}
    if ns.json:
        print_json(status)
        return EXIT_OK
    _print_farm(info)
    sup = status["supervisor"]
    if "error" in sup:
        print(f"supervisor: {clean(str(sup['error']))}")
        return EXIT_OK
    broker = sup.get("broker", {})
    for b in broker.get("brokers", []):  # a farm with several brokers
        mark = "current" if b.get("current") else ("heard" if b.get("connected") else "LOST")
        print(clean(f"  broker {b.get('endpoint')} {mark} (id {b.get('broker_id')})"))
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
    for line in _supervisor_lines(sup.get("supervisors")):
        print(clean(line))
    for r in info.get("restarts", [])[-5:]:
        print(f"  restart: {r['child']} ({r['why']}) at {time.ctime(r['at'])}")
    return EXIT_OK
