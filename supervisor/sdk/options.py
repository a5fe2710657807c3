"""Session options: every option ``corral run`` has, and every other option of
the supervisor's ``create_session`` call, as one typed dataclass.

``to_spec`` gives the ``create_session`` spec (``supervisor/facade.py``
checks it; a bad value comes back as ``SupervisorError(kind="bad_request")``).

=========================  =================================  ==================
option                     ``corral run``                     spec key
=========================  =================================  ==================
workspace                  ``--workspace``                    workspace
model                      ``--model`` (route name,           route / route_spec
                           ``PROVIDER:MODEL``, script:PATH)
base_url                   ``--base-url``                     route_spec
approval                   ``--approval`` (or a policy map)   approval
sandbox                    ``--sandbox``                      sandbox_mode
allow_git_write            ``--allow-git-write``              git_writable
image                      ``--image`` (NAME[:TAG],           image
                           sha256:HEX, NAME@sha256:HEX)
instructions, command_hooks, tool_policy, compaction_threshold_tokens, stream,
session_id, child_route, parent_session_id: the spec keys of the same names
(``command_hooks`` is ``hooks``: command hooks run in the sandbox)
mcp, command_tools         per-session MCP servers and command tools, passed
                           through unchanged as ``mcp`` and ``tools`` (the same
                           keys as ``[mcp.NAME]`` / ``[tools.NAME]`` in
                           corral.toml; the supervisor checks them)
client_wait_s              how long a client tool call waits for its program
                           (``docs/tools.md``, "Client tools")
=========================  =================================  ==================
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sandbox_worker.api import parse_route

Approval = Literal["ask", "allow", "deny"] | Mapping[str, Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionOptions:
    workspace: str | Path
    model: str | None = None
    base_url: str | None = None
    approval: Approval | None = None
    sandbox: Literal["read-only", "workspace-write"] | None = None
    allow_git_write: bool = False
    image: str | None = None  # tools run over this image's root (docs/images.md)
    instructions: str | None = None
    command_hooks: Sequence[Mapping[str, Any]] | None = None
    tool_policy: Mapping[str, Any] | None = None
    compaction_threshold_tokens: int | None = None
    stream: bool | None = None
    session_id: str | None = None
    child_route: str | None = None
    parent_session_id: str | None = None
    mcp: Mapping[str, Mapping[str, Any]] | None = None
    command_tools: Mapping[str, Mapping[str, Any]] | None = None
    client_wait_s: float | None = None

    def to_spec(self) -> dict[str, Any]:
        """The ``create_session`` spec (client tools and hooks are added by the
        client that holds them). ``ValueError`` for a malformed ``model``."""
        spec: dict[str, Any] = {"workspace": str(Path(self.workspace).resolve())}
        if self.model is not None:
            if ":" in self.model:
                route = parse_route(self.model, self.base_url, name=self.model)
                spec["route_spec"] = dict(route)
            else:
                spec["route"] = self.model
        simple = {"approval": self.approval, "sandbox_mode": self.sandbox, "image": self.image,
                  "instructions": self.instructions, "tool_policy": self.tool_policy,
                  "compaction_threshold_tokens": self.compaction_threshold_tokens,
                  "stream": self.stream, "session_id": self.session_id,
                  "child_route": self.child_route,
                  "parent_session_id": self.parent_session_id, "mcp": self.mcp,
                  "tools": self.command_tools, "client_wait_s": self.client_wait_s}
        for key, value in simple.items():
            if value is not None:
                spec[key] = dict(value) if isinstance(value, Mapping) else value
        if self.command_hooks is not None:
            spec["hooks"] = [dict(h) for h in self.command_hooks]
        if self.allow_git_write:
            spec["git_writable"] = True
        return spec
