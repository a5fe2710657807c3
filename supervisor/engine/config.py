"""Engine configuration (process-wide) and session specs (per session).

``EngineConfig`` holds the named model routes and the limits every session
shares. ``SessionSpec`` is what ``SessionManager.create_session`` takes; it is
stored as ``SessionRecord.config`` (``to_config`` / ``from_config``) so a
restarted supervisor rebuilds each session exactly.

Invariants:
- Every limit is bounded and in seconds (``_s``) or counts; no wall-clock expiry.
- A spec is validated when the session is created (``validate``), never later
  in the middle of a turn: an unknown route or a malformed approval policy is
  rejected with ``BadOp`` at creation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from sandbox_worker.api import TOOL_NAMES, ModelRoute, ToolPolicy
from supervisor.engine.approvals import parse_policy
from supervisor.engine.errors import BadOp
from supervisor.engine.hooks import HookEvent
from supervisor.tools.specs import SpecError, parse_command_tools, parse_mcp_servers

MAX_COMMAND_HOOKS = 32


@dataclass(slots=True)
class EngineConfig:
    routes: dict[str, ModelRoute]
    default_route: str = "main"
    instructions: str = "You are a helpful coding agent."
    max_model_steps: int = 256  # per turn
    max_turn_s: float = 3600.0  # total time of one turn
    model_attempts: int = 3  # a lost / retryable model call is re-issued up to this many times
    model_retry_delay_s: float = 0.05
    model_call_budget_s: float = 300.0  # budget sent with each model request
    tool_call_budget_s: float = 600.0
    idempotent_tool_attempts: int = 3
    hook_timeout_s: float = 30.0
    # An approval nobody answers denies its calls after this long (the model
    # reads that, and the turn goes on); None: it waits up to max_turn_s.
    approval_timeout_s: float | None = None
    command_hook_timeout_s: float = 10.0
    compaction_threshold_tokens: int | None = None  # None: only on the compact op
    compaction_keep_recent: int = 4  # items kept verbatim by a summary compaction
    stop_continuations: int = 1  # bounded continuations a stop hook may ask for
    subscriber_queue: int = 10_000  # events buffered per subscriber before it is dropped
    idle_context_items: int = 32  # longer contexts are dropped while idle, reloaded on work
    cancel_grace_s: float = 0.3  # bounded wait for a CANCEL to reach the broker
    export_timeout_s: float = 10.0  # one export sink call
    store_retry_s: float = 5.0  # how long a busy store is retried before the turn fails
    # How long a session's step waits for an unreachable store (PostgreSQL down) before
    # its turn fails store_unavailable ([store] outage_wait_s; engine/outage.py).
    store_outage_s: float = 300.0


@dataclass(slots=True)
class SessionSpec:
    """Everything that configures one session (stored as SessionRecord.config)."""

    workspace: str = "/tmp"
    route: str | None = None  # None: EngineConfig.default_route
    session_id: str | None = None
    instructions: str | None = None
    approval: Any = "ask"  # "ask" | "allow" | "deny" | {"default", "deny", "allow", ...}
    hooks: list[dict[str, Any]] = field(default_factory=list)  # command hooks
    tools: list[str] = field(default_factory=lambda: list(TOOL_NAMES))
    tool_policy: ToolPolicy = field(default_factory=lambda: ToolPolicy())
    parent_session_id: str | None = None
    child_route: str | None = None  # the route children of this session get by default
    compaction_threshold_tokens: int | None = None
    stream: bool = True
    tenant: str | None = None
    middleware: list[str] = field(default_factory=list)  # names for the middleware factory
    # Outside tools (docs/tools.md): server name -> McpServerSpec, tool name ->
    # CommandToolSpec (the session-create request's ``mcp`` and ``tools``).
    mcp: dict[str, Any] = field(default_factory=dict)
    command_tools: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_config(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("session_id")
        d.pop("parent_session_id")
        return d

    @classmethod
    def from_config(cls, d: Mapping[str, Any], *, session_id: str | None = None,
                    parent_session_id: str | None = None) -> SessionSpec:
        known = set(cls.__dataclass_fields__)
        spec = cls(**{k: v for k, v in d.items() if k in known})
        spec.session_id = session_id
        spec.parent_session_id = parent_session_id
        return spec

    def validate(self, config: EngineConfig) -> None:
        """Raise ``BadOp`` saying what is wrong with this spec."""
        if not isinstance(self.workspace, str) or not self.workspace.startswith("/"):
            raise BadOp("spec 'workspace' must be an absolute path")
        for key in ("route", "child_route"):
            value = getattr(self, key)
            if value is not None and value not in config.routes:
                raise BadOp(f"spec {key!r}: unknown route {value!r}; "
                            f"known: {sorted(config.routes)}")
        if self.route is None and config.default_route not in config.routes:
            raise BadOp("no model route: the default route "
                        f"{config.default_route!r} is not configured; add [routes."
                        f"{config.default_route}] to corral.toml, or pass a route "
                        "(corral run --model PROVIDER:MODEL --base-url URL)")
        try:
            parse_policy(self.approval)
        except (ValueError, TypeError) as exc:
            raise BadOp(f"spec 'approval': {exc}") from None
        if not isinstance(self.tools, list) or not all(isinstance(t, str) for t in self.tools):
            raise BadOp("spec 'tools' must be a list of tool names")
        try:
            parse_mcp_servers(self.mcp)
            parse_command_tools(self.command_tools)
        except SpecError as exc:
            raise BadOp(f"spec: {exc}") from None
        if not isinstance(self.hooks, list) or len(self.hooks) > MAX_COMMAND_HOOKS:
            raise BadOp(f"spec 'hooks' must be a list of at most {MAX_COMMAND_HOOKS}")
        events = {str(e) for e in HookEvent}
        for i, hook in enumerate(self.hooks):
            if not isinstance(hook, Mapping):
                raise BadOp(f"hooks[{i}] must be an object")
            if hook.get("event") not in events:
                raise BadOp(f"hooks[{i}].event must be one of {sorted(events)}")
            if not isinstance(hook.get("command"), str) or not hook["command"]:
                raise BadOp(f"hooks[{i}].command must be a non-empty string")
            timeout = hook.get("timeout_s", 10.0)
            if not isinstance(timeout, int | float) or not 0 < timeout <= 600:
                raise BadOp(f"hooks[{i}].timeout_s must be in (0, 600]")
        if self.compaction_threshold_tokens is not None and (
            not isinstance(self.compaction_threshold_tokens, int)
            or self.compaction_threshold_tokens < 1
        ):
            raise BadOp("spec 'compaction_threshold_tokens' must be a positive integer")
