"""The supervisor's facade for clients: maps client-protocol calls onto the
engine (``SessionManager``), the store and the broker, and enforces tenants.

Invariants:
- A client sees only sessions of its own tenant (a client without a tenant
  sees only sessions without one); every refusal is logged.
- Tenants never share a workspace: a new session's workspace may not be,
  contain or lie inside a workspace of another tenant's session.
- Inline routes (``route_spec`` from ``corral run --model PROVIDER:MODEL``)
  are validated with ``sandbox_worker.api.parse_route`` rules, registered
  under their spec string and persisted in ``HOME/routes.json`` so sessions
  using them survive a supervisor restart. They never carry a key.
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
import json
import logging
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from broker.client import BrokerClient
from sandbox_worker.api import PROVIDERS, ModelRoute
from supervisor import config as config_mod
from supervisor.engine.config import EngineConfig, SessionSpec
from supervisor.engine.errors import BadOp, EngineNotRunning, SessionClosed, UnknownSession
from supervisor.export import CheckpointInvalid, file_name, load_loop_checkpoint, verify
from supervisor.export.canonical import canonical_bytes
from supervisor.server import CallError
from supervisor.store import Store
from supervisor.store.records import EventRecord, SessionId
from supervisor.wire import ErrorKind

log = logging.getLogger(__name__)

_SPEC_KEYS = {"workspace", "route", "route_spec", "approval", "instructions", "hooks",
              "tool_policy", "compaction_threshold_tokens", "stream", "session_id",
              "child_route", "parent_session_id"}
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


def _overlap(workspace: str, others: list[str]) -> str | None:
    """The first of ``others`` that is, contains or lies inside ``workspace``."""
    wanted = os.path.realpath(workspace).rstrip(os.sep) + os.sep
    for other in others:
        theirs = os.path.realpath(other).rstrip(os.sep) + os.sep
        if wanted.startswith(theirs) or theirs.startswith(wanted):
            return other
    return None


def event_to_wire(e: EventRecord) -> dict[str, Any]:
    out = {"session_id": e.session_id, "sequence": e.sequence, "type": e.type,
           "payload": e.payload, "created_at": e.created_at}
    if e.submission_id is not None:
        out["submission_id"] = e.submission_id
    return out


class Facade:
    def __init__(self, *, manager: Any, store: Store, broker: BrokerClient,
                 engine_config: EngineConfig, home: Path,
                 defaults: dict[str, Any] | None = None) -> None:
        self.manager = manager
        # Session options from corral.toml, applied where a client gives none.
        self.defaults = defaults or {}
        self.store = store
        self.broker = broker
        self.engine_config = engine_config
        self.routes_file = home / "routes.json"
        self.export_dirs = export_dirs(home)
        self._load_inline_routes()

    # -- routes -------------------------------------------------------------

    def _load_inline_routes(self) -> None:
        try:
            saved = json.loads(self.routes_file.read_text())
        except (OSError, json.JSONDecodeError):
            return
        for name, route in saved.items():
            self.engine_config.routes.setdefault(name, route)

    def register_route(self, spec: Any) -> str:
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
        route: ModelRoute = {**spec, "name": name}  # type: ignore[typeddict-item]
        self.engine_config.routes[name] = route
        inline = {n: r for n, r in self.engine_config.routes.items() if ":" in n}
        tmp = self.routes_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(inline, sort_keys=True))
        os.replace(tmp, self.routes_file)
        return name

    # -- tenancy ------------------------------------------------------------

    async def _check_tenant(self, session_id: str, tenant: str | None) -> None:
        record = await self.store.get_session(SessionId(session_id))
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
        """Tenants never share a workspace: refuse a path that is, contains or lies in
        a workspace of another tenant's session (symlinks resolved, on the
        supervisor's view of the shared storage)."""
        others: dict[str, tuple[str, Any]] = {}
        after: str | None = None
        while True:
            page = await self.store.list_sessions(after=after, limit=1000)
            for r in page.items:
                other = r.config.get("workspace")
                if r.config.get("tenant") != tenant and isinstance(other, str):
                    others[other] = (r.session_id, r.config.get("tenant"))
            if not isinstance(page.next_cursor, str):
                break
            after = page.next_cursor
        clash = await asyncio.to_thread(_overlap, workspace, list(others))
        if clash is not None:
            sid, owner = others[clash]
            log.warning("refused: tenant %r asked for workspace %s, which overlaps session "
                        "%s of tenant %r", tenant, workspace, sid, owner)
            raise CallError(ErrorKind.BAD_REQUEST,
                            f"workspace {workspace} is not available to this client "
                            "(another tenant works there); choose another directory")

    # -- calls --------------------------------------------------------------

    async def create_session(self, spec: dict[str, Any], tenant: str | None) -> str:
        unknown = set(spec) - _SPEC_KEYS
        if unknown:
            raise CallError(ErrorKind.BAD_REQUEST,
                            f"unknown session option(s) {sorted(unknown)}; "
                            f"allowed: {sorted(_SPEC_KEYS)}")
        spec = {**self.defaults, **spec}
        if "route_spec" in spec:
            spec["route"] = self.register_route(spec.pop("route_spec"))
        route = spec.get("route")
        if route is not None and route not in self.engine_config.routes:
            raise CallError(ErrorKind.BAD_REQUEST,
                            f"unknown model route {route!r}; configured: "
                            f"{sorted(self.engine_config.routes)} (or use PROVIDER:MODEL)")
        workspace = spec.get("workspace")
        if not isinstance(workspace, str) or not os.path.isabs(workspace):
            raise CallError(ErrorKind.BAD_REQUEST, "workspace must be an absolute path")
        await self._check_workspace(workspace, tenant)
        fields = {f.name for f in dataclasses.fields(SessionSpec)}
        session_spec = SessionSpec(**{k: v for k, v in spec.items() if k in fields})
        session_spec.tenant = tenant
        with _engine_errors(session_spec.session_id or ""):
            return str(await self.manager.create_session(session_spec))

    async def submit(self, session_id: str, op: dict[str, Any], tenant: str | None) -> str:
        await self._check_tenant(session_id, tenant)
        if op.get("type") == "set_model" and "route_spec" in op:
            op = dict(op)
            op["route"] = self.register_route(op.pop("route_spec"))
        with _engine_errors(session_id):
            return str(await self.manager.submit(SessionId(session_id), op))

    def subscribe(self, session_id: str, after_sequence: int,
                  tenant: str | None) -> AsyncIterator[dict[str, Any]]:
        return self._subscribe(session_id, after_sequence, tenant)

    async def _subscribe(self, session_id: str, after_sequence: int,
                         tenant: str | None) -> AsyncIterator[dict[str, Any]]:
        await self._check_tenant(session_id, tenant)
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
        return {"broker": broker, "sessions": self.manager.stats()}
