"""Farm configuration: ``HOME/corral.toml``, read with the standard ``tomllib``.

``corral up`` writes ``DEFAULT_CONFIG`` (commented) on first run. ``load``
validates every field and raises ``ConfigError`` naming the file, the key and
what to write instead; nothing here reads the network or the environment
except to check that a named credential variable exists.

Invariants:
- API keys are never stored in the config: a route names the environment
  variable of the *worker* that holds its key (``credential_env``).
- Unknown keys are errors (a typo must not silently change behaviour).
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandbox_worker.api import PROVIDERS, TIER_ORDER, ModelRoute, ToolLimits
from sandbox_worker.api import parse_route as parse_api_route

DEFAULT_CONFIG = """\
# Corral farm configuration. Edit and restart the farm (corral down; corral up).
# Every key is optional; the values shown are the defaults.

[farm]
# Sandbox worker processes (default: one per core, at least 2).
# workers = 2
heartbeat_interval_s = 0.25
liveness = 4                 # missed heartbeats before a peer counts as dead
# Remote workers: the broker also binds this HOST:PORT, with CURVE + ZAP
# (keys in HOME/keys, made at start; allow workers with corral keys allow).
# backend_tcp = "0.0.0.0:5556"

[sandbox]
tier_min = "T2"              # refuse to run tools below this tier (T0 < T1 < T2- < T2)
allow_unsandboxed = false    # T0 opt-in; recorded on every tool result
network = false              # grant network to tools (recorded on every result)
mode = "workspace-write"     # or "read-only": the workspace is bound read-only
git_writable = false         # true: tools may write .git (config, hooks run on the host)

[sandbox.limits]
wall_s = 600
cpu_s = 300
address_space_bytes = 4294967296
processes = 256
file_size_bytes = 1073741824
open_files = 1024
output_bytes = 1048576

[session]
default_route = "main"
approval = "ask"             # ask | allow | deny, then rules: deny -> allow -> ask
allow = ["read_file(*)", "list_dir(*)"]
deny = []
ask = []
max_model_steps = 256
turn_timeout_s = 1800
approval_timeout_s = 0       # > 0: an unanswered approval denies its calls after this long
compaction_threshold_tokens = 100000
instructions = "You are a careful coding agent. Use the tools to do the work."

# Model routes. A route is either a provider route or a scripted one.
# Keys come from the workers' environment: CORRAL_API_KEY or the provider's
# usual variable (OPENAI_API_KEY, ANTHROPIC_API_KEY), or credential_env.
#
# [routes.main]
# provider = "openai-chat"     # openai-responses | openai-chat | anthropic
# model = "qwen2.5"
# base_url = "http://127.0.0.1:8000/v1"
#
# [routes.offline]
# script = "script.json"       # a scripted provider serving this file

# Portable checkpoints are exported at every tool boundary to each sink.
# [[export.sinks]]
# type = "directory"           # directory | http
# path = "exports"             # relative to the farm's home
"""

_SECTIONS = {"farm", "sandbox", "session", "routes", "export", "hooks", "tenants"}
_ROUTE_KEYS = {
    "provider", "model", "base_url", "credential_env", "native_compaction",
    "context_window", "max_output_tokens", "connect_timeout_s", "read_timeout_s",
    "max_retries", "script",
}
_LIMIT_KEYS = set(ToolLimits.__annotations__)


class ConfigError(Exception):
    """The configuration file is invalid; the message says where and how to fix it."""


@dataclass(frozen=True)
class FarmConfig:
    home: Path
    workers: int | None = None
    heartbeat_interval_s: float = 0.25
    liveness: int = 4
    backend_tcp: str | None = None  # HOST:PORT for remote workers (docs/multihost.md)
    tier_min: str = "T2"
    allow_unsandboxed: bool = False
    network: bool = False
    sandbox_mode: str = "workspace-write"  # or "read-only" (sandbox_worker.api.SANDBOX_MODES)
    git_writable: bool = False
    limits: dict[str, Any] = field(default_factory=dict)
    default_route: str = "main"
    approval: str = "ask"
    allow: tuple[str, ...] = ("read_file(*)", "list_dir(*)")
    deny: tuple[str, ...] = ()
    ask: tuple[str, ...] = ()
    max_model_steps: int = 256
    turn_timeout_s: float = 1800.0
    approval_timeout_s: float = 0.0  # 0: an approval waits up to the turn's time limit
    model_call_budget_s: float = 300.0  # the deadline sent with each model request
    tool_call_budget_s: float = 600.0  # the deadline sent with each tool request
    compaction_threshold_tokens: int = 100_000
    instructions: str = "You are a careful coding agent. Use the tools to do the work."
    routes: dict[str, ModelRoute] = field(default_factory=dict)  # incl. script routes
    export_sinks: tuple[dict[str, Any], ...] = ()
    hooks: dict[str, Any] = field(default_factory=dict)
    tenants: dict[str, Any] = field(default_factory=dict)


def _fail(path: Path, key: str, why: str) -> ConfigError:
    return ConfigError(f"{path}: [{key}] {why}")


def _check_keys(path: Path, where: str, table: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise _fail(path, where, f"unknown key(s) {unknown}; allowed: {sorted(allowed)}")


def _typed(path: Path, where: str, table: dict[str, Any], key: str, typ: type | tuple[type, ...],
           default: Any) -> Any:
    value = table.get(key, default)
    if value is default:
        return value
    if not isinstance(value, typ) or (isinstance(value, bool) and typ in (int, float)):
        raise _fail(path, f"{where}.{key}", f"must be {typ}, got {value!r}")
    return value


def parse_route(path: Path, name: str, table: dict[str, Any]) -> ModelRoute:
    """One ``[routes.NAME]`` table as a route; a ``script`` route has no base_url
    until the farm starts its scripted provider."""
    _check_keys(path, f"routes.{name}", table, _ROUTE_KEYS)
    if "script" in table:
        script = Path(str(table["script"]))
        if not script.is_absolute():
            script = path.parent / script
        provider = table.get("provider", "openai-responses")
        if provider not in PROVIDERS:
            raise _fail(path, f"routes.{name}.provider", f"must be one of {list(PROVIDERS)}")
        return parse_api_route(f"script:{provider}:{script}", None, name=name)
    provider = table.get("provider")
    if provider not in PROVIDERS:
        raise _fail(path, f"routes.{name}.provider", f"must be one of {list(PROVIDERS)}")
    for key in ("model", "base_url"):
        if not isinstance(table.get(key), str) or not table[key]:
            raise _fail(path, f"routes.{name}.{key}", "is required (a string)")
    route: ModelRoute = {"name": name, **table}  # type: ignore[typeddict-item]
    return route


def load(home: Path) -> FarmConfig:
    """Read ``home/corral.toml`` (missing file: all defaults)."""
    path = home / "corral.toml"
    raw: dict[str, Any] = {}
    if path.exists():
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    _check_keys(path, "top level", raw, _SECTIONS)
    farm = raw.get("farm", {})
    _check_keys(path, "farm", farm, {"workers", "heartbeat_interval_s", "liveness",
                                     "backend_tcp"})
    backend_tcp = _typed(path, "farm", farm, "backend_tcp", str, None)
    if backend_tcp is not None and not re.fullmatch(r"[\w.\-\[\]:*]+:\d{1,5}", backend_tcp):
        raise _fail(path, "farm.backend_tcp", 'must be "HOST:PORT", e.g. "0.0.0.0:5556"')
    sandbox = raw.get("sandbox", {})
    _check_keys(path, "sandbox", sandbox, {"tier_min", "allow_unsandboxed", "network", "limits",
                                           "mode", "git_writable"})
    mode = _typed(path, "sandbox", sandbox, "mode", str, "workspace-write")
    if mode not in ("workspace-write", "read-only"):
        raise _fail(path, "sandbox.mode", 'must be "workspace-write" or "read-only"')
    limits = sandbox.get("limits", {})
    _check_keys(path, "sandbox.limits", limits, _LIMIT_KEYS)
    tier_min = _typed(path, "sandbox", sandbox, "tier_min", str, "T2")
    if tier_min not in TIER_ORDER:
        raise _fail(path, "sandbox.tier_min", f"must be one of {list(TIER_ORDER)}")
    session = raw.get("session", {})
    _check_keys(path, "session", session, {
        "default_route", "approval", "allow", "deny", "ask", "max_model_steps",
        "turn_timeout_s", "approval_timeout_s", "compaction_threshold_tokens", "instructions",
        "model_call_budget_s", "tool_call_budget_s"})
    approval = _typed(path, "session", session, "approval", str, "ask")
    if approval not in ("ask", "allow", "deny"):
        raise _fail(path, "session.approval", "must be ask, allow or deny")
    approval_timeout = session.get("approval_timeout_s", 0)
    if isinstance(approval_timeout, int | float) and not 0 <= approval_timeout <= 86_400:
        raise _fail(path, "session.approval_timeout_s",
                    "must be 0 (wait up to the turn's time limit) or seconds up to 86400")
    routes: dict[str, ModelRoute] = {}
    for name, table in raw.get("routes", {}).items():
        if not isinstance(table, dict):
            raise _fail(path, f"routes.{name}", "must be a table")
        routes[name] = parse_route(path, name, table)
    sinks = raw.get("export", {}).get("sinks", [])
    for i, sink in enumerate(sinks):
        if not isinstance(sink, dict) or sink.get("type") not in ("directory", "http"):
            raise _fail(path, f"export.sinks[{i}]", "needs type = \"directory\" or \"http\"")
    workers = _typed(path, "farm", farm, "workers", int, None)
    if workers is not None and not 1 <= workers <= 256:
        raise _fail(path, "farm.workers", "must be between 1 and 256")
    return FarmConfig(
        home=home,
        workers=workers,
        heartbeat_interval_s=float(_typed(path, "farm", farm, "heartbeat_interval_s",
                                          (int, float), 0.25)),
        liveness=_typed(path, "farm", farm, "liveness", int, 4),
        backend_tcp=backend_tcp,
        tier_min=tier_min,
        allow_unsandboxed=_typed(path, "sandbox", sandbox, "allow_unsandboxed", bool, False),
        network=_typed(path, "sandbox", sandbox, "network", bool, False),
        sandbox_mode=mode,
        git_writable=_typed(path, "sandbox", sandbox, "git_writable", bool, False),
        limits=dict(limits),
        default_route=_typed(path, "session", session, "default_route", str, "main"),
        approval=approval,
        allow=tuple(_typed(path, "session", session, "allow", list,
                           ["read_file(*)", "list_dir(*)"])),
        deny=tuple(_typed(path, "session", session, "deny", list, [])),
        ask=tuple(_typed(path, "session", session, "ask", list, [])),
        max_model_steps=_typed(path, "session", session, "max_model_steps", int, 256),
        turn_timeout_s=float(_typed(path, "session", session, "turn_timeout_s",
                                    (int, float), 1800.0)),
        approval_timeout_s=float(_typed(path, "session", session, "approval_timeout_s",
                                        (int, float), 0.0)),
        model_call_budget_s=float(_typed(path, "session", session, "model_call_budget_s",
                                         (int, float), 300.0)),
        tool_call_budget_s=float(_typed(path, "session", session, "tool_call_budget_s",
                                        (int, float), 600.0)),
        compaction_threshold_tokens=_typed(path, "session", session,
                                           "compaction_threshold_tokens", int, 100_000),
        instructions=_typed(path, "session", session, "instructions", str,
                            FarmConfig.instructions),
        routes=routes,
        export_sinks=tuple(sinks),
        hooks=dict(raw.get("hooks", {})),
        tenants=dict(raw.get("tenants", {})),
    )


def write_default(home: Path) -> Path:
    """Write the commented default config unless one exists; returns its path."""
    home.mkdir(parents=True, exist_ok=True)
    path = home / "corral.toml"
    if not path.exists():
        path.write_text(DEFAULT_CONFIG)
    return path
