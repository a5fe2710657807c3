"""``corral export``, ``verify`` and ``import``: portable checkpoints.

``export`` writes the session's latest checkpoint (made at each tool boundary)
atomically (a temporary file, then rename); ``verify`` checks a file's digests
and consistency and lists every problem; ``import`` resumes a checkpoint in the
store of a stopped SQLite farm, or of a PostgreSQL farm running or not (a supervisor
claims the new session, unleased, as it claims a dead one's), under the capability
binding (tools and policy) this farm would give the session: a checkpoint never
resumes under other tools or policy. Everything read from a checkpoint file is
untrusted and reaches the terminal only through ``render.clean``.

The export, store and engine modules are imported by the handlers, not with
the parser.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

from supervisor.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    Subparsers,
    add_home,
    add_json,
)
from supervisor.cli.output import print_json, say_error
from supervisor.cli.reach import with_farm
from supervisor.cli.render import clean

# corral import on a running PostgreSQL farm waits this long for a supervisor to claim
# the session (they look for unowned sessions every 0.5 s).
CLAIM_WAIT_S = 10.0


def add_parsers(sub: Subparsers) -> None:
    p = sub.add_parser("export", help="write a session's latest portable checkpoint",
                       description="Write the session's latest checkpoint (made at each "
                       "tool boundary) to --out; 'corral verify' checks it and 'corral "
                       "import' resumes it in another farm.")
    add_home(p)
    p.add_argument("session", help="the session id (see 'corral sessions')")
    p.add_argument("--out", type=Path, required=True, help="the file to write")
    add_json(p)
    p.set_defaults(handler=cmd_export)

    p = sub.add_parser("verify", help="check a checkpoint file's digests and consistency",
                       description="Exits 0 when the checkpoint verifies, 1 on any tampering "
                       "or inconsistency (each problem is listed).")
    p.add_argument("file", type=Path, help="a checkpoint written by 'corral export'")
    add_json(p)
    p.set_defaults(handler=cmd_verify)

    p = sub.add_parser("import", help="resume an exported session in this farm's store",
                       description="Import a checkpoint from 'corral export' into the store "
                       "of the farm at HOME: a SQLite farm must be stopped (its supervisor is "
                       "the file's only writer); on a PostgreSQL store ([store] url) the "
                       "farm may run, and one of its supervisors takes the session. The "
                       "session continues with 'corral run --session ID'.")
    add_home(p)
    p.add_argument("file", type=Path, help="a checkpoint written by 'corral export'")
    p.add_argument("--session", default=None, help="the new session id (default: same)")
    p.add_argument("--workspace", type=Path, default=None,
                   help="the imported session's workspace (default: the current directory)")
    p.add_argument("--model", default=None,
                   help="route name from corral.toml (default: the configured default route)")
    p.add_argument("--approval", default=None, choices=["ask", "allow", "deny"],
                   help="the approval policy the session ran with, when it was not the "
                   "corral.toml default (it is part of the checkpoint's capability binding)")
    add_json(p)
    p.set_defaults(handler=cmd_import)


def cmd_export(ns: Namespace) -> int:
    code, result = with_farm(ns, "export", session_id=ns.session)
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
        return say_error(ns, "cannot_write", f"cannot write {out}: {exc.strerror}; choose "
                         "another --out", EXIT_FAILED)
    descriptor = doc["descriptor"]
    if ns.json:
        print_json({"ok": True, "path": str(out), "digest": descriptor["digest"],
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
        print_json({"ok": not problems, "problems": problems, "file": str(ns.file)})
    elif problems:
        print(f"{ns.file}: FAILED", file=sys.stderr)
        for p in problems:
            print(f"  - {clean(p)}", file=sys.stderr)  # text from an untrusted file
    else:
        print(f"{ns.file}: ok")
    return EXIT_OK if not problems else EXIT_FAILED


def import_spec(ns: Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The session config an import creates in the farm at HOME (its corral.toml
    defaults, route, workspace, ``--approval``) and the capability binding that
    config gives the session; raises ``ConfigError`` saying what is wrong."""
    from supervisor import config as config_mod
    from supervisor.engine.config import SessionSpec
    from supervisor.engine.tooling import session_binding
    from supervisor.facade import pin_workspace
    from supervisor.main import session_defaults
    from supervisor.server import CallError

    home: Path = ns.home.resolve()
    config_mod.write_default(home)
    cfg = config_mod.load(home)
    routes = set(cfg.routes)
    with contextlib.suppress(OSError, ValueError, AttributeError):
        routes |= set(json.loads((home / "routes.json").read_text()))
    route = ns.model or cfg.default_route
    if route not in routes:
        raise config_mod.ConfigError(
            f"unknown model route {route!r}; routes of this farm: {sorted(routes)} (add one "
            f"to {home / 'corral.toml'} or pass --model)")
    workspace = (ns.workspace or Path.cwd()).resolve()
    if not workspace.is_dir():
        raise config_mod.ConfigError(f"workspace {workspace} is not a directory; create it "
                                     "or pass --workspace")
    try:  # the checks and the identity pin create_session makes
        real, extra = pin_workspace(str(workspace), home)
    except CallError as exc:
        raise config_mod.ConfigError(exc.message) from None
    values: dict[str, Any] = {**session_defaults(cfg), "workspace": real, "route": route}
    if ns.approval:
        values["approval"] = ns.approval
    values, outside = _outside_tools(values, ns)
    spec = SessionSpec(**values)
    spec.extra = {**spec.extra, **extra, **outside}
    return spec.to_config(), session_binding(spec)


def _outside_tools(values: dict[str, Any], ns: Namespace
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The session's own MCP servers, command tools (over corral.toml's, per
    name) and client tool declarations, as ``create_session`` takes them (the
    SDK's import passes them; the CLI has none): the binding names them all."""
    from supervisor import clienttools
    from supervisor.config import ConfigError
    from supervisor.server import CallError
    from supervisor.tools.specs import SpecError, merged, parse_command_tools, parse_mcp_servers

    mcp, tools, client = (getattr(ns, k, None) for k in ("mcp", "command_tools",
                                                          "client_tools"))
    try:
        values["mcp"] = parse_mcp_servers(merged(values.get("mcp"), mcp))
        values["command_tools"] = parse_command_tools(merged(values.get("command_tools"),
                                                             tools))
        extra = clienttools.declaration({"client_tools": list(client or []),
                                         "command_tools": values["command_tools"]})
    except SpecError as exc:
        raise ConfigError(str(exc)) from None
    except CallError as exc:
        raise ConfigError(exc.message) from None
    return values, extra


def binding_difference(doc: dict[str, Any], expected: dict[str, Any]) -> str:
    try:
        have = doc["content"]["logical_resume"]["capability_binding"]
        parts = []
        for field, key, what in (("tools", "schema_digest", "tools"),
                                 ("mcp_servers", "spec_digest", "MCP servers"),
                                 ("client_tools", "schema_digest", "client tools")):
            mine = {t["name"]: t[key] for t in expected.get(field, [])}
            theirs = {t["name"]: t[key] for t in have.get(field, [])}
            if mine != theirs:
                changed = sorted(n for n in set(mine) | set(theirs)
                                 if mine.get(n) != theirs.get(n))
                parts.append(f"{what} differ ({', '.join(changed)})")
        if have.get("policy_digest") != expected.get("policy_digest"):
            parts.append("the approval/tool policy differs")
        return "; ".join(parts) or "the binding differs"
    except (KeyError, TypeError, AttributeError):
        return "the binding is malformed"


async def _claimed(store: Any, session_id: str, wait_s: float = CLAIM_WAIT_S) -> bool:
    """Wait (bounded) until a supervisor of the running farm holds the imported session's
    lease, so the next 'corral run --session' finds its owner; False: not yet (it is
    claimed as soon as a supervisor of the farm runs)."""
    from supervisor.store import SessionId, StoreError

    locate = getattr(store, "locate", None)
    if locate is None:
        return False
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        with contextlib.suppress(StoreError):
            if await locate(SessionId(session_id)) is not None:
                return True
        await asyncio.sleep(0.1)
    return False


def cmd_import(ns: Namespace) -> int:
    from supervisor.config import ConfigError
    from supervisor.export import BindingMismatch, CheckpointInvalid
    from supervisor.export import import_checkpoint as do_import
    from supervisor.facade import check_workspace
    from supervisor.farm.layout import FarmPaths
    from supervisor.farm.root import running_farm
    from supervisor.server import CallError
    from supervisor.store import SessionId, StoreError
    from supervisor.store.errors import SessionExists
    from supervisor.store.opening import configured_url, open_for_home

    try:
        doc = json.loads(ns.file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return say_error(ns, "cannot_read", f"cannot read {ns.file}: {exc}", EXIT_USAGE)
    try:
        shared = configured_url(ns.home) is not None
    except ConfigError as exc:
        return say_error(ns, "config", str(exc), EXIT_USAGE)
    running = running_farm(ns.home) is not None
    if running and not shared:
        return say_error(ns, "farm_running", f"stop the farm first (corral down --home "
                         f"{ns.home}): the supervisor is the SQLite store's only writer",
                         EXIT_USAGE)
    try:
        config, binding = import_spec(ns)
    except ConfigError as exc:
        return say_error(ns, "bad_request", str(exc), EXIT_USAGE)

    async def go() -> str:
        paths = FarmPaths.of(ns.home)
        paths.prepare()
        store = await open_for_home(ns.home)  # SQLite, or [store] url
        try:
            wanted = ns.session or doc.get("descriptor", {}).get("session_id")
            if isinstance(wanted, str) and await store.get_session(SessionId(wanted)):
                raise SessionExists(f"session {wanted} already exists in {ns.home}")
            await check_workspace(store, str(config["workspace"]), None)
            record = await do_import(store, doc, expected_binding=binding,
                                     new_session_id=ns.session, config=config)
            if running:  # PostgreSQL: a supervisor claims the new session (no lease yet)
                await _claimed(store, str(record.session_id))
            return str(record.session_id)
        finally:
            await store.close()

    try:
        session = asyncio.run(go())
    except CheckpointInvalid as exc:
        return say_error(ns, "checkpoint_invalid", f"import refused: {exc}; see every "
                         f"problem with: corral verify {ns.file}", EXIT_FAILED)
    except BindingMismatch:
        return say_error(ns, "binding_mismatch", "import refused: the checkpoint was made "
                         "with other capabilities than this farm would give the session: "
                         f"{binding_difference(doc, binding)}. A checkpoint never resumes "
                         "under other tools or policy: import it into a farm with the same "
                         "[session]/[sandbox] settings in corral.toml, or pass the "
                         "--approval the session ran with", EXIT_FAILED)
    except CallError as exc:
        return say_error(ns, exc.kind, f"import refused: {exc.message}", EXIT_FAILED)
    except StoreError as exc:
        hint = (" pass --session NEW_ID to import it under another id"
                if getattr(exc, "kind", "") == "session_exists" else "")
        return say_error(ns, str(getattr(exc, "kind", "") or "store_error"),
                         f"import refused: {exc};{hint}" if hint else
                         f"import refused: {exc}", EXIT_FAILED)
    if ns.json:
        sys.stdout.write(json.dumps({"ok": True, "session_id": session}) + "\n")
    else:
        print(f"imported as session {session}; continue with: corral run --session {session} "
              "PROMPT")
    os.sync()
    return EXIT_OK
