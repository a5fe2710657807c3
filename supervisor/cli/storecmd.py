"""``corral store migrate``: bring the farm's store (SQLite or ``[store] url``) to this
Corral's schema version. The store modules are imported by the handler, not with the
parser."""

from __future__ import annotations

import asyncio
from argparse import Namespace

from supervisor.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, Subparsers, add_home, add_json
from supervisor.cli.output import print_json, say_error


def add_parsers(sub: Subparsers) -> None:
    top = sub.add_parser("store", help="maintain the farm's session store (schema migrations)",
                         description="The farm's session store: HOME/corral.db (SQLite), or "
                         "the PostgreSQL database of [store] url in corral.toml.")
    group = top.add_subparsers(dest="store_command", metavar="SUBCOMMAND", required=True)
    p = group.add_parser("migrate", help="apply the schema migrations the store lacks",
                         description="Apply, in order and each in its own transaction, the "
                         "schema migrations the store lacks. A PostgreSQL store is never "
                         "migrated by a supervisor starting (several share it): run this "
                         "once when a supervisor refuses the store's schema version. A "
                         "store newer than this Corral is refused and left untouched.")
    add_home(p)
    add_json(p)
    p.set_defaults(handler=cmd_store_migrate)


def cmd_store_migrate(ns: Namespace) -> int:
    from supervisor import config as config_mod
    from supervisor.store.errors import StoreError
    from supervisor.store.migrating import migrate_home

    try:
        done = asyncio.run(migrate_home(ns.home))
    except config_mod.ConfigError as exc:
        return say_error(ns, "bad_config", str(exc), EXIT_USAGE)
    except StoreError as exc:
        return say_error(ns, exc.kind, f"store migrate: {exc.message}", EXIT_FAILED)
    if ns.json:
        print_json({"ok": True, "store": done.where, "from_version": done.before,
                    "to_version": done.after})
    elif done.before == done.after:
        print(f"store {done.where} is at schema version {done.after}; nothing to do")
    else:
        print(f"store {done.where} migrated from schema version {done.before} to "
              f"{done.after}")
    return EXIT_OK
