"""The supervisor's facade for clients: maps client-protocol calls onto the
engine (``SessionManager``), the store and the broker, and enforces tenants.

Invariants:
- A client sees only sessions of its own tenant (a client without a tenant
  sees only sessions without one); every refusal is logged.
- Tenants never share a workspace: a new session's workspace may not be,
  contain or lie inside a workspace of another tenant's session; and no
  session's workspace contains or lies inside another session's, whatever
  the tenant (a tool of the outer one could swap the inner one's path).
- A workspace is an existing directory that does not overlap the farm's
  home, run directory or export directories, in either direction; it is
  stored resolved, with its identity (device, inode) pinned for the workers.
- Inline routes (``route_spec`` from ``corral run --model PROVIDER:MODEL``)
  are validated with ``sandbox_worker.api.parse_route`` rules, registered
  under their spec string and persisted in ``HOME/routes.json`` so sessions
  using them survive a supervisor restart. They never carry a key, never
  replace a route of corral.toml or another tenant's inline route, and name no
  ``credential_env`` but the farm's routes' own (``register_route``).
- Every answer is plain msgpack-friendly data.
- ``export`` answers the latest checkpoint of a session: the one under export
  in the store while a turn runs (``load_loop_checkpoint``), else the newest
  file of that session in the farm's directory sinks; never one that fails
  ``verify`` and never one above ``MAX_EXPORT_ANSWER_BYTES``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import socket
import stat
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from broker.brokerset import BrokerSet
from broker.client import BrokerClient
from sandbox_worker.api import GENERIC_ENV, PROVIDER_ENV, PROVIDERS, SANDBOX_MODES, ModelRoute
from supervisor import clienttools, handover, leasing
from supervisor import config as config_mod
from supervisor.engine.config import EngineConfig, SessionSpec
from supervisor.engine.errors import BadOp, EngineNotRunning, SessionClosed, UnknownSession
from supervisor.export import CheckpointInvalid, file_name, load_loop_checkpoint, verify
from supervisor.export.canonical import canonical_bytes
from supervisor.farm.layout import FarmPaths
from supervisor.images.session import resolve_image
from supervisor.server import CallError
from supervisor.store import SessionStore, StoreError
from supervisor.store.records import EventRecord, SessionId
from supervisor.tools.specs import SpecError, merged, parse_command_tools, parse_mcp_servers
from supervisor.wire import ErrorKind

log = logging.getLogger(__name__)

_SPEC_KEYS = {"workspace", "route", "route_spec", "approval", "instructions", "hooks",
              "tool_policy", "compaction_threshold_tokens", "stream", "session_id",
              "child_route", "parent_session_id", "sandbox_mode", "git_writable",
              "mcp", "tools", "image", *clienttools.SPEC_KEYS}
_ROUTE_KEYS = set(ModelRoute.__annotations__)
# A checkpoint answer must fit in one client-protocol message (8 MiB) with room to spare.
MAX_EXPORT_ANSWER_BYTES = 6 * 1024 * 1024
MAX_EXPORT_FILES_SCANNED = 1000


def export_dirs(home: Path) -> list[Path]:
    """The farm's directory export sinks (HOME/exports when none is configured)."""
    try:
        sinks = config_mod.load(home).export_sinks
    except config_mod.ConfigError:
        sinks = ()
    dirs = []
    for sink in sinks:
        if sink.get("type") == "directory":
            path = Path(str(sink.get("path", "exports")))
            dirs.append(path if path.is_absolute() else home / path)
    return dirs or [home / "exports"]


def _newest_export(dirs: list[Path], session_id: str) -> tuple[dict[str, Any], Path] | None:
    """The newest checkpoint file of ``session_id`` that verifies (blocking; run in a thread)."""
    stem = file_name({"descriptor": {"session_id": session_id, "turn": 0,
                                     "digest": ""}}).rsplit("-t0000-", 1)[0]
    found: list[tuple[float, Path]] = []
    for d in dirs:
        try:
            with os.scandir(d) as it:
                for entry in it:
                    if len(found) >= MAX_EXPORT_FILES_SCANNED:
                        break
                    if entry.name.startswith(stem + "-t") and entry.name.endswith(".json"):
                        found.append((entry.stat().st_mtime, Path(entry.path)))
        except OSError:
            continue
    for _, path in sorted(found, reverse=True):
        try:
            if path.stat().st_size > MAX_EXPORT_ANSWER_BYTES:
                continue
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not verify(doc) and doc["descriptor"]["session_id"] == session_id:
            return doc, path
    return None


@contextlib.contextmanager
def _engine_errors(session_id: str) -> Iterator[None]:
    """Translate the engine's caller errors into typed answers (one boundary)."""
    try:
        yield
    except BadOp as exc:
        raise CallError(ErrorKind.BAD_OP, str(exc)) from None
    except UnknownSession:
        raise CallError(ErrorKind.UNKNOWN_SESSION,
                        f"no session {session_id!r}; list them with: corral sessions") from None
    except SessionClosed as exc:
        raise CallError(ErrorKind.BAD_OP, f"session {session_id} is closed: {exc}") from None
    except EngineNotRunning:
        raise CallError(ErrorKind.UNAVAILABLE, "the supervisor is starting or stopping; "
                        "try again in a moment") from None


def _overlap(workspace: str, others: list[str], *, nested_only: bool = False) -> str | None:
    """The first of ``others`` that is, contains or lies inside ``workspace``
    (with ``nested_only``: contains or lies inside, but is not the same)."""
    wanted = os.path.realpath(workspace).rstrip(os.sep) + os.sep
    for other in others:
        theirs = os.path.realpath(other).rstrip(os.sep) + os.sep
        if nested_only and theirs == wanted:
            continue
        if wanted.startswith(theirs) or theirs.startswith(wanted):
            return other
    return None


def _pin_workspace(workspace: str, farm_dirs: list[str]) -> tuple[str, list[int]]:
    """The resolved workspace and its (device, inode); CallError when it is
    missing, not a directory, or overlaps one of the farm's own directories."""
    real = os.path.realpath(workspace)
    try:
        st = os.stat(real)
    except FileNotFoundError:
        raise CallError(ErrorKind.BAD_REQUEST, f"workspace {workspace} does not exist; "
                        "create it or choose another directory") from None
    except OSError as exc:
        raise CallError(ErrorKind.BAD_REQUEST,
                        f"workspace {workspace} cannot be used: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise CallError(ErrorKind.BAD_REQUEST, f"workspace {workspace} is not a directory; "
                        "choose a directory")
    clash = _overlap(real, farm_dirs)
    if clash is not None:
        raise CallError(ErrorKind.BAD_REQUEST,
                        f"workspace {real} overlaps the farm's own directory {clash} (its "
                        "store, keys, logs or sockets would be open to the tools); choose a "
                        "workspace outside the farm's home, or a home outside the workspace")
    return real, [st.st_dev, st.st_ino]


async def check_workspace(store: SessionStore, workspace: str, tenant: str | None) -> None:
    """Refuse (``CallError``) a workspace nested in (or holding) another
    session's, whatever the tenant, and one that is, contains or lies in a
    workspace of another tenant's session (symlinks resolved, on the
    supervisor's view of the shared storage). Also used by ``corral import``."""
    others: dict[str, tuple[str, Any]] = {}
    everyone: dict[str, str] = {}
    after: str | None = None
    while True:
        page = await store.list_sessions(after=after, limit=1000)
        for r in page.items:
            other = r.config.get("workspace")
            if not isinstance(other, str):
                continue
            everyone[other] = r.session_id
            if r.config.get("tenant") != tenant:
                others[other] = (r.session_id, r.config.get("tenant"))
        if not isinstance(page.next_cursor, str):
            break
        after = page.next_cursor
    nested = await asyncio.to_thread(_overlap, workspace, list(everyone), nested_only=True)
    if nested is not None and nested not in others:
        log.warning("refused: workspace %s is nested with %s of session %s", workspace,
                    nested, everyone[nested])
        raise CallError(ErrorKind.BAD_REQUEST,
                        f"workspace {workspace} contains or lies inside the workspace "
                        f"{nested} of session {everyone[nested]}: a tool of the outer "
                        "one could replace the inner one; use the same directory or "
                        "one outside it")
    clash = await asyncio.to_thread(_overlap, workspace, list(others))
    if clash is not None:
        sid, owner = others[clash]
        log.warning("refused: tenant %r asked for workspace %s, which overlaps session "
                    "%s of tenant %r", tenant, workspace, sid, owner)
        raise CallError(ErrorKind.BAD_REQUEST,
                        f"workspace {workspace} is not available to this client "
                        "(another tenant works there); choose another directory")


def farm_dirs(home: Path) -> list[str]:
    """Directories no workspace may overlap: the home (corral.db, keys/, logs/,
    exports/), its run directory (sockets; in /tmp for deep homes) and the
    configured export directories."""
    return [str(home.resolve()), str(FarmPaths.of(home).run),
            *(str(d) for d in export_dirs(home))]


def pin_workspace(workspace: str, home: Path) -> tuple[str, dict[str, Any]]:
    """The resolved workspace and the session ``extra`` fields pinning it
    (identity and host); ``CallError`` as ``_pin_workspace``. Blocking."""
    real, identity = _pin_workspace(workspace, farm_dirs(home))
    return real, {"workspace_identity": identity, "workspace_host": socket.gethostname()}


def _sandbox_options(spec: dict[str, Any]) -> None:
    """Move the session options ``sandbox_mode`` and ``git_writable`` into the
    session's tool policy (every tool call carries them; every isolation
    record states them)."""
    mode = spec.pop("sandbox_mode", None)
    git = spec.pop("git_writable", None)
    if mode is None and git is None:
        return
    policy = dict(spec.get("tool_policy") or {})
    if mode is not None:
        if mode not in SANDBOX_MODES:
            raise CallError(ErrorKind.BAD_REQUEST,
                            f"sandbox_mode must be one of {', '.join(SANDBOX_MODES)}")
        policy["sandbox_mode"] = mode
    if git is not None:
        if not isinstance(git, bool):
            raise CallError(ErrorKind.BAD_REQUEST, "git_writable must be true or false")
        policy["git_writable"] = git
    spec["tool_policy"] = policy


def _outside_options(defaults: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """``given`` over ``defaults``, with the session's ``mcp`` and ``tools``
    (command tools) over corral.toml's (``defaults``' ``mcp`` and
    ``command_tools``, from ``main.session_defaults``) per name, parsed and checked
    (``supervisor.tools.specs``) into the SessionSpec fields ``mcp`` and
    ``command_tools`` (SessionSpec's own ``tools`` lists the built-ins)."""
    spec = {**defaults, **given}
    try:
        spec["mcp"] = parse_mcp_servers(merged(defaults.get("mcp"), given.get("mcp")))
        spec["command_tools"] = parse_command_tools(merged(defaults.get("command_tools"),
                                                           given.get("tools")))
    except SpecError as exc:
        raise CallError(ErrorKind.BAD_REQUEST, str(exc)) from None
    spec.pop("tools", None)
    return spec


def event_to_wire(e: EventRecord) -> dict[str, Any]:
    out = {"session_id": e.session_id, "sequence": e.sequence, "type": e.type,
           "payload": e.payload, "created_at": e.created_at}
    if e.submission_id is not None:
        out["submission_id"] = e.submission_id
    return out


class Facade:
    def __init__(self, *, manager: Any, store: SessionStore, broker: BrokerClient | BrokerSet,
                 engine_config: EngineConfig, home: Path,
                 defaults: dict[str, Any] | None = None) -> None:
        self.manager = manager
        # Session options from corral.toml, applied where a client gives none.
        self.defaults = defaults or {}
        self.store = store
        self.broker = broker
        self.engine_config = engine_config
        self.routes_file = home / "routes.json"
        # The routes of corral.toml: no client's route_spec may replace one.
        self.configured_routes = frozenset(engine_config.routes)
        self.route_credentials = frozenset(
            {GENERIC_ENV, *PROVIDER_ENV.values()}
            | {str(r["credential_env"]) for r in engine_config.routes.values()
               if r.get("credential_env")})
        self.export_dirs = export_dirs(home)
        self.farm_dirs = farm_dirs(home)
        self.home = home
        self._load_inline_routes()

    # -- routes -------------------------------------------------------------

    def _saved_routes(self) -> dict[str, Any]:
        try:
            saved = json.loads(self.routes_file.read_text())
        except (OSError, json.JSONDecodeError):
            return {}
        return saved if isinstance(saved, dict) else {}

    def _load_inline_routes(self) -> None:
        for name, route in self._saved_routes().items():
            if name not in self.configured_routes:
                self.engine_config.routes.setdefault(name, route)

    def reload_inline_routes(self) -> None:
        """Take the inline routes (``PROVIDER:MODEL``, ``script:PATH``) as the home's
        supervisors last registered them, over this one's older copies: a session taken
        over from another supervisor of this home may use one registered there (a
        ``corral run --model script:PATH`` registers a new provider URL each run)."""
        for name, route in self._saved_routes().items():
            if ":" in name and name not in self.configured_routes:
                self.engine_config.routes[name] = route

    def _save_route(self, name: str, route: ModelRoute, tenant: str | None) -> None:
        """Add one route to HOME/routes.json, under a lock (several supervisors of a home
        register routes: each writing its whole set once put back another's stale URL).
        A route registered by one tenant (or by clients without one) is never replaced
        by another's: HOME/routes.owners.json names who registered each."""
        owners_file = self.routes_file.with_name("routes.owners.json")
        with open(self.routes_file.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            saved = self._saved_routes()
            try:
                owners = json.loads(owners_file.read_text())
            except (OSError, json.JSONDecodeError):
                owners = {}
            if not isinstance(owners, dict):
                owners = {}
            if name in saved and name in owners and owners[name] != tenant \
                    and saved[name] != route:
                raise CallError(ErrorKind.BAD_REQUEST,
                                f"route {name!r} is registered by another tenant; give "
                                "your route_spec another name")
            owners[name] = tenant
            tmp = owners_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(owners, sort_keys=True))
            os.replace(tmp, owners_file)
            saved[name] = route
            tmp = self.routes_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(saved, sort_keys=True))
            os.replace(tmp, self.routes_file)

    def register_route(self, spec: Any, tenant: str | None = None) -> str:
        """A client's inline route (``route_spec``), registered under its name. It may
        not replace a route of corral.toml (every session on that route would send its
        conversation, and the workers' key, where the client says), nor one another
        tenant registered, and may only name a key variable corral.toml's routes use
        (or the default ones): never another secret of the workers."""
        if not isinstance(spec, dict) or not set(spec) <= _ROUTE_KEYS:
            raise CallError(ErrorKind.BAD_REQUEST,
                            f"route_spec must be a map with keys among {sorted(_ROUTE_KEYS)}")
        if spec.get("provider") not in PROVIDERS or not isinstance(spec.get("model"), str):
            raise CallError(ErrorKind.BAD_REQUEST,
                            f"route_spec needs provider (one of {list(PROVIDERS)}) and model")
        if not isinstance(spec.get("base_url"), str) or not spec["base_url"].startswith(
                ("http://", "https://")):
            raise CallError(ErrorKind.BAD_REQUEST, "route_spec needs an http(s) base_url")
        name = str(spec.get("name") or f"{spec['provider']}:{spec['model']}")
        if ":" not in name or name in self.configured_routes:
            raise CallError(ErrorKind.BAD_REQUEST,
                            f"route_spec name {name!r} must be an inline name "
                            "(PROVIDER:MODEL or script:PATH), not a route of corral.toml; "
                            "to use a configured route give route = NAME")
        cred = spec.get("credential_env")
        if cred is not None and cred not in self.route_credentials:
            raise CallError(ErrorKind.BAD_REQUEST,
                            f"route_spec credential_env {cred!r} is not a key variable of "
                            "this farm's routes; use one of "
                            f"{sorted(self.route_credentials)} or configure the route in "
                            "corral.toml")
        route: ModelRoute = {**spec, "name": name}  # type: ignore[typeddict-item]
        self._save_route(name, route, tenant)
        self.engine_config.routes[name] = route
        return name

    # -- tenancy ------------------------------------------------------------

    async def _check_tenant(self, session_id: str, tenant: str | None) -> None:
        # A session in memory answers from its record (no store read: describe shows a
        # session paused by a store outage while the store is unreachable).
        live = self.manager.sessions.get(SessionId(session_id))
        record = live.record if live is not None else \
            await self.store.get_session(SessionId(session_id))
        if record is None:
            raise CallError(ErrorKind.UNKNOWN_SESSION,
                            f"no session {session_id!r}; list them with: corral sessions")
        owner = record.config.get("tenant")
        if owner != tenant:
            log.warning("refused: tenant %r tried to reach session %s of tenant %r",
                        tenant, session_id, owner)
            # Same answer as for a missing session: do not reveal other tenants.
            raise CallError(ErrorKind.UNKNOWN_SESSION,
                            f"no session {session_id!r}; list them with: corral sessions")

    async def _check_workspace(self, workspace: str, tenant: str | None) -> None:
        await check_workspace(self.store, workspace, tenant)

    # -- calls --------------------------------------------------------------

    async def create_session(self, spec: dict[str, Any], tenant: str | None) -> str:
        unknown = set(spec) - _SPEC_KEYS
        if unknown:
            raise CallError(ErrorKind.BAD_REQUEST,
                            f"unknown session option(s) {sorted(unknown)}; "
                            f"allowed: {sorted(_SPEC_KEYS)}")
        spec = _outside_options(self.defaults, spec)
        if "route_spec" in spec:
            spec["route"] = self.register_route(spec.pop("route_spec"), tenant)
        route = spec.get("route")
        if route is not None and route not in self.engine_config.routes:
            raise CallError(ErrorKind.BAD_REQUEST,
                            f"unknown model route {route!r}; configured: "
                            f"{sorted(self.engine_config.routes)} (or use PROVIDER:MODEL)")
        workspace = spec.get("workspace")
        if not isinstance(workspace, str) or not os.path.isabs(workspace):
            raise CallError(ErrorKind.BAD_REQUEST, "workspace must be an absolute path")
        _sandbox_options(spec)
        await self._image_option(spec)
        client_extra = clienttools.declaration(spec)  # client tools and hooks
        real, identity = await asyncio.to_thread(_pin_workspace, workspace, self.farm_dirs)
        await self._check_workspace(real, tenant)
        spec["workspace"] = real
        fields = {f.name for f in dataclasses.fields(SessionSpec)}
        session_spec = SessionSpec(**{k: v for k, v in spec.items() if k in fields})
        session_spec.tenant = tenant
        # Workers refuse the workspace once it is no longer this directory.
        session_spec.extra = {**session_spec.extra, "workspace_identity": identity,
                              "workspace_host": socket.gethostname(), **client_extra}
        with _engine_errors(session_spec.session_id or ""):
            return str(await self.manager.create_session(session_spec))

    async def _image_option(self, spec: dict[str, Any]) -> None:
        """The session's ``image`` (or a ``tool_policy.image`` given directly)
        resolved to its manifest digest in the session's tool policy; refused
        here, never at the first tool call (``supervisor/images/session.py``)."""
        policy = dict(spec.get("tool_policy") or {})
        ref = spec.pop("image", None)
        if ref is None:
            ref = policy.get("image")
        if ref is None:
            return
        policy["image"] = await resolve_image(ref, self.home, self.broker)
        spec["tool_policy"] = policy

    async def submit(self, session_id: str, op: dict[str, Any], tenant: str | None) -> str:
        await self._check_tenant(session_id, tenant)
        if op.get("type") == "set_model" and "route_spec" in op:
            op = dict(op)
            op["route"] = self.register_route(op.pop("route_spec"), tenant)
        with _engine_errors(session_id):
            return str(await self.manager.submit(SessionId(session_id), op))

    def subscribe(self, session_id: str, after_sequence: int,
                  tenant: str | None) -> AsyncIterator[dict[str, Any]]:
        return self._subscribe(session_id, after_sequence, tenant)

    async def _subscribe(self, session_id: str, after_sequence: int,
                         tenant: str | None) -> AsyncIterator[dict[str, Any]]:
        await self._check_tenant(session_id, tenant)
        # Several supervisors: a session between owners is held until one resumes it.
        await handover.await_owner(self.store, self.manager.sessions, session_id, tenant)
        async for event in self.manager.subscribe(SessionId(session_id),
                                                  after_sequence=after_sequence):
            yield event_to_wire(event) if isinstance(event, EventRecord) else event

    async def list_sessions(self, args: dict[str, Any], tenant: str | None) -> Any:
        limit = args.get("limit", 100)
        if not isinstance(limit, int) or not 1 <= limit <= 1000:
            raise CallError(ErrorKind.BAD_REQUEST, "limit must be between 1 and 1000")
        after = args.get("after")
        page = await self.store.list_sessions(after=after if isinstance(after, str) else None,
                                              limit=limit)
        sessions = [
            {"session_id": r.session_id, "status": r.status, "created_at": r.created_at,
             "route": r.config.get("route"), "workspace": r.config.get("workspace"),
             "parent_session_id": r.parent_session_id}
            for r in page.items if r.config.get("tenant") == tenant
        ]
        return {"sessions": sessions, "next": page.next_cursor}

    async def delete_session(self, session_id: str, tenant: str | None) -> Any:
        """Remove a terminated session from the store (``corral delete``)."""
        await self._check_tenant(session_id, tenant)
        if SessionId(session_id) in self.manager.sessions:
            raise CallError(ErrorKind.BAD_OP, f"session {session_id} is not terminated; "
                            f"terminate it first: corral terminate {session_id}")
        await self.store.delete_session(SessionId(session_id))
        log.info("session %s deleted", session_id)
        return True

    async def describe(self, session_id: str, tenant: str | None) -> Any:
        await self._check_tenant(session_id, tenant)
        with _engine_errors(session_id):
            described: dict[str, Any] = dict(await self.manager.describe(SessionId(session_id)))
        return described

    async def history(self, session_id: str, after_sequence: int, limit: int,
                      tenant: str | None) -> Any:
        await self._check_tenant(session_id, tenant)
        page = await self.store.events_page(SessionId(session_id),
                                            after_sequence=after_sequence, limit=limit)
        return {"events": [event_to_wire(e) for e in page.items], "next": page.next_cursor}

    async def export(self, session_id: str, tenant: str | None) -> Any:
        await self._check_tenant(session_id, tenant)
        doc: dict[str, Any] | None
        try:
            doc = await load_loop_checkpoint(self.store, SessionId(session_id))
        except CheckpointInvalid as exc:
            log.warning("session %s: the checkpoint under export is inconsistent: %s",
                        session_id, exc)
            doc = None
        source = "store"
        if doc is None:
            newest = await asyncio.to_thread(_newest_export, self.export_dirs, session_id)
            if newest is None:
                raise CallError(ErrorKind.NOT_FOUND,
                                f"session {session_id} has no checkpoint yet: one is made at "
                                "the end of each tool round of a turn; run a turn with a tool "
                                "call first")
            doc, path = newest
            source = str(path)
        size = len(canonical_bytes(doc))
        if size > MAX_EXPORT_ANSWER_BYTES:
            raise CallError(ErrorKind.BAD_REQUEST,
                            f"the checkpoint is {size} bytes, too large for one answer; copy "
                            f"it from the export directory {self.export_dirs[0]}")
        return {"checkpoint": doc, "source": source}

    async def status(self) -> Any:
        try:
            broker = await self.broker.status(timeout_s=2.0)
        except Exception as exc:  # status must answer even when the broker does not
            broker = {"error": f"{type(exc).__name__}: {exc}"}
        out = {"broker": broker, "sessions": self.manager.stats()}
        try:
            leases = await leasing.lease_status(self.store)  # several supervisors only
        except StoreError as exc:
            leases = {"error": str(exc)}
        if leases is not None:
            out["supervisors"] = leases
        return out
