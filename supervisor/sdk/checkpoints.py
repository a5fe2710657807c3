"""Importing a portable checkpoint (``Session.export``) into a farm's store, as
``corral import`` does: into the home of a farm that is *not* running (the
supervisor is its store's only writer), under the capability binding that
farm would give the session (a checkpoint never resumes under other tools or
policy). Start a farm on that home afterwards and ``resume`` the session.

Errors: ``ImportRefused(kind, message)`` with kind ``farm_running``,
``invalid`` (digests or consistency), ``binding`` (other tools or policy),
``config`` (route, workspace) or ``store`` (e.g. the session id exists).
"""

from __future__ import annotations

import asyncio
import contextlib
from argparse import Namespace
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from supervisor.sdk.tools import ClientTool


class ImportRefused(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


def _prepare(home: str | Path, workspace: str | Path, model: str | None,
             approval: str | None, outside: dict[str, Any]
             ) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """Blocking: the farm must be stopped; the session config and its binding."""
    from supervisor.cli.checkpoints import import_spec
    from supervisor.config import ConfigError
    from supervisor.farm.layout import FarmPaths
    from supervisor.farm.root import running_farm

    home = Path(home).resolve()
    if running_farm(home) is not None:
        raise ImportRefused("farm_running", f"stop the farm at {home} first: its supervisor "
                            "is the store's only writer")
    ns = Namespace(home=home, workspace=Path(workspace), model=model, approval=approval,
                   **outside)
    try:
        config, binding = import_spec(ns)
    except ConfigError as exc:
        raise ImportRefused("config", str(exc)) from None
    FarmPaths.of(home).prepare()
    return home, config, binding


async def import_checkpoint(home: str | Path, checkpoint: Mapping[str, Any], *,
                            workspace: str | Path, session_id: str | None = None,
                            model: str | None = None, approval: str | None = None,
                            mcp: Mapping[str, Mapping[str, Any]] | None = None,
                            command_tools: Mapping[str, Mapping[str, Any]] | None = None,
                            tools: Sequence[ClientTool] = ()) -> str:
    """Import ``checkpoint`` into the stopped farm at ``home``; returns the
    session id (``session_id``, default the checkpoint's own).

    The session gets what ``create_session`` would give it there: corral.toml's
    ``[mcp.NAME]`` / ``[tools.NAME]`` with ``mcp`` / ``command_tools`` over them
    per name, and ``tools`` (client tools) declared. The checkpoint's binding
    must name exactly these (``binding`` refusal otherwise, naming what
    differs); hold the client tools afterwards with ``resume(sid, tools=...)``."""
    from supervisor.export import BindingMismatch, CheckpointInvalid
    from supervisor.export import import_checkpoint as do_import
    from supervisor.facade import check_workspace
    from supervisor.server import CallError
    from supervisor.store import SessionId, StoreError
    from supervisor.store.opening import open_for_home

    outside = {"mcp": mcp, "command_tools": command_tools,
               "client_tools": [t.declaration() for t in tools]}
    where, config, binding = await asyncio.to_thread(_prepare, home, workspace, model,
                                                     approval, outside)
    doc = dict(checkpoint)
    store = await open_for_home(where)  # SQLite, or [store] url
    try:
        wanted = session_id or doc.get("descriptor", {}).get("session_id")
        if isinstance(wanted, str) and await store.get_session(SessionId(wanted)):
            raise ImportRefused("store", f"session {wanted} already exists in {where}; "
                                "pass session_id= to import it under another id")
        await check_workspace(store, str(config["workspace"]), None)
        record = await do_import(store, doc, expected_binding=binding,
                                 new_session_id=SessionId(session_id) if session_id else None,
                                 config=config)
        return str(record.session_id)
    except CheckpointInvalid as exc:
        raise ImportRefused("invalid", str(exc)) from None
    except BindingMismatch:
        from supervisor.cli.checkpoints import binding_difference

        raise ImportRefused("binding", f"the checkpoint was made with other tools or policy "
                            f"than this farm gives the session: "
                            f"{binding_difference(doc, binding)}") from None
    except CallError as exc:
        raise ImportRefused("config", exc.message) from None
    except StoreError as exc:
        raise ImportRefused("store", str(exc)) from None
    finally:
        with contextlib.suppress(Exception):
            await store.close()
