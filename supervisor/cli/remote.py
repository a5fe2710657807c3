"""The multi-host commands of ``corral``: ``keys`` and ``worker``, and the hosts
view of ``corral status``.

- ``corral keys init`` writes the farm's broker and supervisor key pairs.
- ``corral keys new NAME [--dir DIR]`` writes a key pair (secret 0600).
- ``corral keys allow FILE [--tenant T] [--role R]`` puts a public key on the
  farm's allow-list (re-read by the running broker and supervisor, no restart).
- ``corral worker --broker tcp://HOST:PORT --server-key FILE --key FILE``
  becomes a sandbox worker process (``exec``), so SIGTERM reaches the worker
  itself and drains it; it reconnects forever with backoff.

Invariants: these commands never import ``sandbox_worker`` internals (the
worker is started as ``python -m sandbox_worker``); errors name the fix and
exit 2.
"""

from __future__ import annotations

import json
import os
import sys
from argparse import Namespace
from pathlib import Path
from typing import Any

from broker.endpoints import connect_endpoint
from supervisor.cli.common import (
    EXIT_OK,
    EXIT_USAGE,
    Subparsers,
    add_home,
    add_json,
    bounded,
)
from supervisor.cli.output import say_error


def add_parsers(sub: Subparsers) -> None:
    p = sub.add_parser("keys", help="CURVE keys and the allow-list of a farm",
                       description="Key management for farms across hosts: see "
                       "docs/multihost.md.")
    keys = p.add_subparsers(dest="keys_command", metavar="KEYS_COMMAND", required=True)
    k = keys.add_parser("init", help="write the farm's broker and supervisor key pairs")
    add_home(k)
    add_json(k)
    k.set_defaults(handler=cmd_keys_init)
    k = keys.add_parser("new", help="write a key pair NAME.key and NAME.key_secret (0600)")
    k.add_argument("name", help="the key's name: writes NAME.key and NAME.key_secret")
    k.add_argument("--dir", type=Path, default=Path("."), help="where (default: here)")
    add_json(k)
    k.set_defaults(handler=cmd_keys_new)
    k = keys.add_parser("allow", help="put a public key on the farm's allow-list",
                        description="Copies the public key of FILE into HOME/keys/allowed; "
                        "the running broker and supervisor pick it up without a restart.")
    add_home(k)
    k.add_argument("file", type=Path, help="a NAME.key file")
    k.add_argument("--tenant", default=None, help="bind a client key to this tenant")
    k.add_argument("--role", default=None, choices=["worker", "client", "supervisor"],
                   help="what the key may do (default: client with --tenant, else worker)")
    k.add_argument("--name", default=None, help="name on the allow-list (default: file stem)")
    add_json(k)
    k.set_defaults(handler=cmd_keys_allow)

    p = sub.add_parser("worker", help="run sandbox workers for a farm on another host",
                       description="Become a sandbox worker process serving a remote "
                       "broker over CURVE; reconnects forever, drains on SIGTERM.")
    p.add_argument("--broker", action="append", default=None, type=connect_endpoint,
                   help="a broker's backend, tcp://HOST:PORT; repeat it to serve several "
                   "brokers at once (one --server-key for all: the farm's broker key); "
                   "default: [farm] broker_backends in HOME/corral.toml")
    add_home(p)
    p.add_argument("--server-key", type=Path, default=None, help="the broker's public key")
    p.add_argument("--key", type=Path, default=None, help="this worker's NAME.key_secret")
    p.add_argument("--services", default="tool,model", help="default: tool,model")
    p.add_argument("--tier-min", default=None, help="lowest sandbox tier to accept, e.g. T2")
    p.add_argument("--capacity", type=bounded(int, 1, 4096), default=4,
                   help="requests at once (default 4, at most 4096)")
    p.add_argument("--drain-s", type=bounded(float, 0), default=5.0,
                   help="seconds to finish the calls in flight on SIGTERM (default 5)")
    p.add_argument("--heartbeat-interval-s", type=bounded(float, 0, above=True), default=None,
                   help="seconds between heartbeats (default: the worker's, 0.25)")
    p.add_argument("--liveness", type=bounded(int, 1), default=None,
                   help="missed heartbeats before the broker is taken as gone "
                   "(default: the worker's, 4)")
    p.add_argument("--worker-log-level", default="INFO",
                   help="log level of the worker processes (default INFO)")
    p.set_defaults(handler=cmd_worker)


def _out(ns: Namespace, obj: dict[str, Any], text: str) -> None:
    if getattr(ns, "json", False):
        sys.stdout.write(json.dumps(obj, sort_keys=True) + "\n")
    else:
        print(text)


def _keys_failed(ns: Namespace, exc: Exception) -> int:
    return say_error(ns, "keys", f"keys: {exc}", EXIT_USAGE)


def cmd_keys_new(ns: Namespace) -> int:
    from supervisor.keys import KeyFileError, new_key  # zmq: with the handler, not --help

    try:
        pub, sec = new_key(ns.name, ns.dir)
    except (KeyFileError, OSError) as exc:
        return _keys_failed(ns, exc)
    _out(ns, {"public": str(pub), "secret": str(sec)},
         f"wrote {pub} (public: share it) and {sec} (secret, mode 0600: keep it)")
    return EXIT_OK


def cmd_keys_allow(ns: Namespace) -> int:
    from supervisor.keys import KeyFileError, allow

    role = ns.role or ("client" if ns.tenant else "worker")
    try:
        path = allow(ns.file, ns.home, role=role, tenant=ns.tenant, name=ns.name)
    except (KeyFileError, OSError) as exc:
        return _keys_failed(ns, exc)
    _out(ns, {"allowed": str(path), "role": role, "tenant": ns.tenant},
         f"allowed {path.stem} as {role}"
         + (f" of tenant {ns.tenant}" if ns.tenant else "") + f" ({path})")
    return EXIT_OK


def cmd_keys_init(ns: Namespace) -> int:
    from supervisor.keys import KeyFileError, ensure_farm_keys

    try:
        fk = ensure_farm_keys(ns.home)
    except (KeyFileError, OSError) as exc:
        return _keys_failed(ns, exc)
    _out(ns, {"keys": str(fk.directory), "broker": str(fk.public("broker")),
              "supervisor": str(fk.public("supervisor"))},
         f"farm keys in {fk.directory}; give workers {fk.public('broker')} and "
         f"clients {fk.public('supervisor')}")
    return EXIT_OK


def worker_argv(ns: Namespace) -> list[str]:
    """The ``python -m sandbox_worker`` command line ``corral worker`` becomes."""
    brokers = [arg for ep in ns.broker for arg in ("--broker", ep)]
    argv = [sys.executable, "-m", "sandbox_worker", *brokers,
            "--services", ns.services, "--capacity", str(ns.capacity),
            "--drain-s", str(ns.drain_s), "--log-level", ns.worker_log_level]
    if ns.server_key is not None:
        argv += ["--server-key", str(ns.server_key), "--key", str(ns.key)]
    if ns.tier_min is not None:
        argv += ["--tier-min", ns.tier_min]
    if ns.heartbeat_interval_s is not None:
        argv += ["--heartbeat-interval-s", str(ns.heartbeat_interval_s)]
    if ns.liveness is not None:
        argv += ["--liveness", str(ns.liveness)]
    return argv


def cmd_worker(ns: Namespace) -> int:
    problem = _worker_brokers(ns)
    if problem is not None:
        print(f"corral worker: {problem}", file=sys.stderr)
        return EXIT_USAGE
    if (any(ep.startswith("tcp://") for ep in ns.broker)
            and (ns.server_key is None or ns.key is None)):
        print("corral worker: a tcp:// broker needs --server-key (the broker's public key) "
              "and --key (this worker's NAME.key_secret, allowed with: corral keys allow "
              "NAME.key --role worker)", file=sys.stderr)
        return EXIT_USAGE
    if (ns.server_key is None) != (ns.key is None):
        print("corral worker: give --server-key and --key together", file=sys.stderr)
        return EXIT_USAGE
    argv = worker_argv(ns)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)  # never returns: this process becomes the worker


def _worker_brokers(ns: Namespace) -> str | None:
    """``ns.broker`` from ``--broker`` (which wins) or ``[farm] broker_backends`` of
    HOME/corral.toml; the problem to show (None: fine)."""
    from supervisor import config as config_mod

    if ns.broker:
        return None
    try:
        ns.broker = list(config_mod.load(ns.home).broker_lists[1])
    except config_mod.ConfigError as exc:
        return str(exc)
    if not ns.broker:
        return (f"no broker to serve: give --broker tcp://HOST:PORT (repeat it for "
                f"several), or list them in {ns.home / 'corral.toml'}: "
                '[farm] broker_backends = ["tcp://HOST:5556"]')
    return None


def render_hosts(broker: dict[str, Any]) -> list[str]:
    """``corral status``: one line per worker, grouped by host (from broker STATUS)."""
    seen: dict[str, dict[str, Any]] = {}
    for svc in broker.get("workers", {}).values():
        for w in svc.get("workers", []):
            seen.setdefault(str(w.get("identity")), w)
    by_host: dict[str, list[dict[str, Any]]] = {}
    for w in seen.values():
        info = w.get("info") or {}
        by_host.setdefault(str(info.get("host", "?")), []).append(w)
    lines = []
    for host, workers in sorted(by_host.items()):
        lines.append(f"  host {host}: {len(workers)} worker(s)")
        for w in workers:
            info = w.get("info") or {}
            tool: dict[str, Any] = info["tool"] if isinstance(info.get("tool"), dict) else {}
            tier = tool.get("tier") or info.get("tier") or "-"
            ident = str(w.get("identity"))[:24]
            services = ",".join(w.get("services", []))
            load = f"{w.get('in_flight', 0)}/{w.get('capacity', 0)}"
            lines.append(f"    {ident:<24} {services:<10} tier {tier!s:<4} load {load:<7} "
                         f"last heartbeat {float(w.get('last_seen_s', 0)):.2f}s ago")
    return lines
