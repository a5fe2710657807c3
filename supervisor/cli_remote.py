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
from typing import Any

from supervisor.cli import EXIT_OK, EXIT_USAGE
from supervisor.keys import KeyFileError, allow, ensure_farm_keys, new_key


def _out(ns: Namespace, obj: dict[str, Any], text: str) -> None:
    if getattr(ns, "json", False):
        sys.stdout.write(json.dumps(obj, sort_keys=True) + "\n")
    else:
        print(text)


def cmd_keys(ns: Namespace) -> int:
    try:
        if ns.keys_command == "new":
            pub, sec = new_key(ns.name, ns.dir)
            _out(ns, {"public": str(pub), "secret": str(sec)},
                 f"wrote {pub} (public: share it) and {sec} (secret, mode 0600: keep it)")
        elif ns.keys_command == "allow":
            role = ns.role or ("client" if ns.tenant else "worker")
            path = allow(ns.file, ns.home, role=role, tenant=ns.tenant, name=ns.name)
            _out(ns, {"allowed": str(path), "role": role, "tenant": ns.tenant},
                 f"allowed {path.stem} as {role}"
                 + (f" of tenant {ns.tenant}" if ns.tenant else "") + f" ({path})")
        else:
            fk = ensure_farm_keys(ns.home)
            _out(ns, {"keys": str(fk.directory), "broker": str(fk.public("broker")),
                      "supervisor": str(fk.public("supervisor"))},
                 f"farm keys in {fk.directory}; give workers {fk.public('broker')} and "
                 f"clients {fk.public('supervisor')}")
    except (KeyFileError, OSError) as exc:
        print(f"corral keys: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK


def worker_argv(ns: Namespace) -> list[str]:
    """The ``python -m sandbox_worker`` command line ``corral worker`` becomes."""
    argv = [sys.executable, "-m", "sandbox_worker", "--broker", ns.broker,
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
    if ns.broker.startswith("tcp://") and (ns.server_key is None or ns.key is None):
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
