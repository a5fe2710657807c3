"""Farm configuration: ``HOME/corral.toml``, read with the standard ``tomllib``.

``corral init`` (or the first ``corral up``/``run``) writes ``DEFAULT_CONFIG``
(commented) with a working ``[routes.main]``: a provider whose key is in the
environment, else the scripted demo model (``first_route``). ``load``
validates every field and raises ``ConfigError`` naming the file, the key and
what to write instead, with types in words ("an integer"); a file that is
not UTF-8 is said so, with the byte and line. Nothing here reads the network;
the environment is read only to see which provider keys are set (never their
values) when the first config is written.

Invariants:
- API keys are never stored in the config: a route names the environment
  variable of the *worker* that holds its key (``credential_env``).
- Unknown keys are errors (a typo must not silently change behaviour), and so
  are unknown ``[[hooks.EVENT]]`` events: a hook in the file is either run
  (every session's command hooks, in the sandbox) or refused at start-up.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from broker import endpoints
from sandbox_worker.api import PROVIDERS, TIER_ORDER, ModelRoute, ToolLimits
from sandbox_worker.api import parse_route as parse_api_route
from supervisor.engine.config import MAX_COMMAND_HOOKS
from supervisor.engine.hooks import HookEvent
from supervisor.tools.specs import SpecError, parse_command_tools, parse_mcp_servers

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
# Brokers (1..4): with 2, workers serve both and the supervisor moves off a
# lost one; backend_tcp then gives broker N the port + N - 1 (docs/multihost.md).
# brokers = 1
# Supervisors (1..8) sharing the sessions; more than 1 needs [store] url (PostgreSQL).
# supervisors = 1
# Joining a farm on other hosts: the brokers a supervisor (python -m supervisor)
# or a worker (corral worker) started here uses when no --broker is given.
# broker_frontends = ["tcp://broker1:5555", "tcp://broker2:5555"]
# broker_backends = ["tcp://broker1:5556", "tcp://broker2:5556"]

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

# Model routes. A route is either a provider route or a scripted one; a
# session uses default_route unless corral run --model names another.
# Keys come from the workers' environment: CORRAL_API_KEY or the provider's
# usual variable (OPENAI_API_KEY, ANTHROPIC_API_KEY), or credential_env.
#
# [routes.local]
# provider = "openai-chat"     # openai-responses | openai-chat | anthropic
# model = "qwen2.5"
# base_url = "http://127.0.0.1:8000/v1"
#
# [routes.offline]
# script = "script.json"       # a scripted provider serving this file (docs/models.md)

# Command hooks: a program run IN THE SANDBOX (as a shell tool call) at a hook
# event, with the event as JSON on stdin. The last line of its stdout may be a
# JSON verdict, e.g. {"deny": "why"} or {"allow": true}; empty output: no
# opinion. For pre_tool, permission_request and user_prompt_submit a crash,
# a timeout or unreadable output counts as DENY. Events: session_start,
# user_prompt_submit, pre_model, model_request, pre_tool, permission_request,
# post_tool, pre_compact, post_compact, stop, turn_end, session_end.
# [[hooks.pre_tool]]
# command = "python3 /opt/policy/check_tool.py"
# timeout_s = 10               # (0, 600]; default 10

# MCP servers (docs/tools.md): a stdio server runs IN THE SANDBOX (the session's
# workspace, its own uid, no network unless network = true); its tools are
# offered as mcp__NAME__TOOL. A url server is called from the worker; its
# headers come from the workers' environment by variable name.
# [mcp.git]
# command = ["/opt/mcp-git/bin/mcp-server-git"]
# [mcp.docs]
# url = "https://mcp.example.com/mcp"
# headers_env = { Authorization = "CORRAL_MCP_DOCS_AUTH" }

# Command tools: arguments as JSON on stdin, in the sandbox; stdout is the result.
# [tools.wordcount]
# description = "Count the words of a text."
# parameters = { type = "object", properties = { text = { type = "string" } } }
# command = ["python3", "-c", "import json,sys; print(len(json.load(sys.stdin)['text'].split()))"]
# read_only = true             # and idempotent: run again after a lost worker
# Telemetry (docs/operations.md): off by default.
# [telemetry]
# metrics_listen = "127.0.0.1:9464"   # Prometheus /metrics (corral up --metrics)
# otlp_endpoint = "http://127.0.0.1:4318"  # OTLP/HTTP traces; OTEL_* variables win
# record_content = false       # true: spans carry prompts, tool arguments and outputs
# [web]
# listen = "127.0.0.1:8765"    # the read-only live page (corral up --web)
# [store]
# url = "postgresql://corral@db.example:5432/corral"  # sessions on PostgreSQL, shared by
#                              # several supervisors (docs/storage.md); default: HOME/corral.db
# lease_s = 10                 # a supervisor paused or dead this long loses its sessions
# outage_wait_s = 300          # a turn waits this long for an unreachable store, then
#                              # fails store_unavailable (reported when it is back)

# Portable checkpoints are exported at every tool boundary to each sink.
# [[export.sinks]]
# type = "directory"           # directory | http
# path = "exports"             # relative to the farm's home
"""

_SECTIONS = {"farm", "sandbox", "session", "routes", "export", "hooks", "mcp", "tools",
             "telemetry", "web", "store"}
_HOST_PORT = re.compile(r"[\w.\-\[\]:]+:\d{1,5}")
_ROUTE_KEYS = {
    "provider", "model", "base_url", "credential_env", "native_compaction",
    "context_window", "max_output_tokens", "connect_timeout_s", "read_timeout_s",
    "max_retries", "script",
}
_LIMIT_KEYS = set(ToolLimits.__annotations__)


class ConfigError(Exception):
    """The configuration file is invalid; the message says where and how to fix it.

    ``key`` is the dotted key at fault (``farm.liveness``), when there is one: ``load``
    adds the line it is on to the message (``corral.toml, line 8: [farm.liveness] ...``).
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class FarmConfig:
    home: Path
    workers: int | None = None
    heartbeat_interval_s: float = 0.25
    liveness: int = 4
    backend_tcp: str | None = None  # HOST:PORT for remote workers (docs/multihost.md)
    brokers: int = 1  # broker processes of the farm (docs/multihost.md, "Several brokers")
    supervisors: int = 1  # supervisor processes on the shared store (docs/multihost.md)
    # [farm] broker_frontends / broker_backends: another host's farm this one joins
    # (supervisors / workers started here without --broker; docs/multihost.md).
    broker_lists: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
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
    metrics_listen: str | None = None  # [telemetry] HOST:PORT of /metrics
    otlp_endpoint: str | None = None  # [telemetry] OTLP/HTTP base URL for traces
    record_content: bool = False  # [telemetry] spans carry prompts/arguments/outputs
    web_listen: str | None = None  # [web] listen: HOST:PORT of the live page
    store_url: str | None = None  # [store] url: PostgreSQL; None: SQLite HOME/corral.db
    store_lease_s: float = 10.0  # [store] lease_s: a session's lease (PostgreSQL only)
    store_outage_s: float = 300.0  # [store] outage_wait_s: a step waits for the store
    # [[hooks.EVENT]] tables as the session spec's command hooks:
    # ({"event", "command", "timeout_s"}, ...) in file order.
    hooks: tuple[dict[str, Any], ...] = ()
    # [mcp.NAME] and [tools.NAME] (docs/tools.md), parsed by supervisor.tools.specs.
    mcp: dict[str, Any] = field(default_factory=dict)
    command_tools: dict[str, Any] = field(default_factory=dict)


def _fail(path: Path, key: str, why: str, at: str | None = None) -> ConfigError:
    """The error of ``key``; ``at`` the key whose line to name, when not ``key``."""
    return ConfigError(f"{path}: [{key}] {why}", key=at or key)


def _check_keys(path: Path, where: str, table: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(allowed), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        at = unknown[0] if where == "top level" else f"{where}.{unknown[0]}"
        raise _fail(path, where, f"unknown key(s) {unknown}{hint}; allowed: "
                    f"{sorted(allowed)}", at=at)


def _above_zero(path: Path, where: str, table: dict[str, Any], key: str,
                typ: type | tuple[type, ...], default: Any, least: float = 0.0) -> Any:
    """A number that must be above 0 (``least`` 0) or at least ``least``."""
    value = _typed(path, where, table, key, typ, default)
    if (value <= 0) if least == 0 else (value < least):
        bound = "above 0" if least == 0 else f"at least {least:g}"
        raise _fail(path, f"{where}.{key}", f"must be {bound}, got {value!r}")
    return value


_HEADER = re.compile(r"\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY_PART = re.compile(r"""\s*(?:"[^"]*"|'[^']*'|[^.]+)""")
_ASSIGN = re.compile(r"\s*([A-Za-z0-9_\-.\"' ]+?)\s*=")


def _bare(dotted: str) -> list[str]:
    """``a."b c".d`` -> ``["a", "b c", "d"]`` (quotes and blanks around parts gone)."""
    return [part.strip().strip("\"'") for part in _KEY_PART.findall(dotted)]


def key_line(text: str, key: str) -> int | None:
    """The line (1-based) where the dotted ``key`` (``farm.liveness``,
    ``hooks.pre_tool[0].timeout_s``, or a table name) is written in the TOML ``text``:
    its assignment or its table's header; None when the file does not spell it."""
    want = _bare(re.sub(r"\[\d+\]", "", key))
    table: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("#"):
            continue
        header = _HEADER.match(line)
        if header is not None:
            table = _bare(header.group(1))
            if table[:len(want)] == want:
                return number
            continue
        assign = _ASSIGN.match(line)
        if assign is not None and (table + _bare(assign.group(1)))[:len(want)] == want:
            return number
    return None


_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
               list: "a list", dict: "a table"}


def _type_words(typ: type | tuple[type, ...]) -> str:
    """``int`` -> "an integer"; ``(int, float)`` -> "a number" (what the user writes)."""
    types = typ if isinstance(typ, tuple) else (typ,)
    if set(types) == {int, float}:
        return "a number"
    return " or ".join(_TYPE_WORDS.get(t, t.__name__) for t in types)


def _typed(path: Path, where: str, table: dict[str, Any], key: str, typ: type | tuple[type, ...],
           default: Any) -> Any:
    value = table.get(key, default)
    if value is default:
        return value
    types = typ if isinstance(typ, tuple) else (typ,)
    if not isinstance(value, typ) or (isinstance(value, bool) and bool not in types):
        raise _fail(path, f"{where}.{key}", f"must be {_type_words(typ)}, got {value!r}")
    return value


def _table(path: Path, where: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(path, where, f"must be a table ([{where}]), got {value!r}")
    return value


def parse_hooks(path: Path, table: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    """``[[hooks.EVENT]]`` tables -> the session's command hooks, checked here so a
    hook the user wrote is either run or refused at start-up, never ignored."""
    events = [str(e) for e in HookEvent]
    hooks: list[dict[str, Any]] = []
    for event, entries in table.items():
        if event not in events:
            raise _fail(path, f"hooks.{event}", f"unknown hook event; one of {events}")
        if isinstance(entries, dict):
            entries = [entries]
        if not isinstance(entries, list):
            raise _fail(path, f"hooks.{event}", "must be a list of tables "
                        f"([[hooks.{event}]] with command = \"...\")")
        for i, entry in enumerate(entries):
            where = f"hooks.{event}[{i}]"
            _check_keys(path, where, _table(path, where, entry), {"command", "timeout_s"})
            command = entry.get("command")
            if not isinstance(command, str) or not command.strip():
                raise _fail(path, f"{where}.command", "is required (the program to run, "
                            "a non-empty string)")
            timeout_s = _typed(path, where, entry, "timeout_s", (int, float), 10.0)
            if not 0 < timeout_s <= 600:
                raise _fail(path, f"{where}.timeout_s", "must be above 0 and at most 600")
            hooks.append({"event": event, "command": command, "timeout_s": float(timeout_s)})
    if len(hooks) > MAX_COMMAND_HOOKS:
        raise _fail(path, "hooks", f"at most {MAX_COMMAND_HOOKS} hooks")
    return tuple(hooks)




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


def parse_store(path: Path, table: dict[str, Any]) -> tuple[str | None, float]:
    """``[store] url``: a PostgreSQL URL (docs/storage.md), or None for SQLite; and
    ``lease_s``, the lease of a session between supervisors (docs/multihost.md)."""
    from supervisor.store.url import BadStoreUrl, check_url

    _check_keys(path, "store", table, {"url", "lease_s", "outage_wait_s"})
    lease_s = float(_typed(path, "store", table, "lease_s", (int, float), 10.0))
    if not 1.0 <= lease_s <= 600.0:
        raise _fail(path, "store.lease_s", "must be between 1 and 600 seconds")
    url = _typed(path, "store", table, "url", str, None)
    if url is None:
        return None, lease_s
    try:
        return check_url(url), lease_s
    except BadStoreUrl as exc:
        raise _fail(path, "store.url", str(exc)) from None


def parse_store_outage(path: Path, table: dict[str, Any]) -> float:
    """``[store] outage_wait_s``: how long a session's step waits for an unreachable
    store before its turn fails ``store_unavailable`` (docs/storage.md)."""
    wait_s = float(_typed(path, "store", table, "outage_wait_s", (int, float), 300.0))
    if not 1.0 <= wait_s <= 86_400.0:
        raise _fail(path, "store.outage_wait_s", "must be between 1 and 86400 seconds")
    return wait_s


def _syntax_error(path: Path, text: str, exc: tomllib.TOMLDecodeError) -> str:
    """``corral.toml, line 8: not valid TOML: Invalid value (at line 8, column 28):
    'liveness = '``: the parser's words, and the line it stopped at as written."""
    found = re.search(r"at line (\d+), column \d+", str(exc))
    if found is None:
        return f"{path}: not valid TOML: {exc}"
    number = int(found.group(1))
    lines = text.splitlines()
    written = lines[number - 1].strip() if 0 < number <= len(lines) else ""
    return (f"{path}, line {number}: not valid TOML: {exc}"
            + (f": {written[:120]!r}" if written else ""))


def load(home: Path) -> FarmConfig:
    """Read ``home/corral.toml`` (missing file: all defaults). A ``ConfigError`` names
    the file, the line and the key at fault."""
    path = home / "corral.toml"
    text = ""
    try:
        return _load(home, path)
    except ConfigError as exc:
        if exc.key is None:
            raise
        with contextlib.suppress(OSError, UnicodeDecodeError):
            text = path.read_text(encoding="utf-8")
        line = key_line(text, exc.key)
        if line is None:
            raise
        message = str(exc).replace(f"{path}: ", f"{path}, line {line}: ", 1)
        raise ConfigError(message, key=exc.key) from None


def _load(home: Path, path: Path) -> FarmConfig:
    raw: dict[str, Any] = {}
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        data = None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror}); check its permissions"
                          ) from None
    if data is not None:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = data[: exc.start].count(b"\n") + 1
            raise ConfigError(f"{path}: not UTF-8 text (byte {data[exc.start]:#04x} on line "
                              f"{line}); save the file as UTF-8") from None
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(_syntax_error(path, text, exc)) from None
    _check_keys(path, "top level", raw, _SECTIONS)
    for section in _SECTIONS:
        if section in raw:
            _table(path, section, raw[section])
    farm = raw.get("farm", {})
    _check_keys(path, "farm", farm, {"workers", "heartbeat_interval_s", "liveness",
                                     "backend_tcp", "brokers", "supervisors",
                                     "broker_frontends", "broker_backends"})
    backend_tcp = _typed(path, "farm", farm, "backend_tcp", str, None)
    if backend_tcp is not None and (
            not re.fullmatch(r"[\w.\-\[\]:*]+:\d{1,5}", backend_tcp)
            or endpoints.problem(f"tcp://{backend_tcp}", bind=True) is not None):
        raise _fail(path, "farm.backend_tcp", 'must be "HOST:PORT" (PORT 1..65535), e.g. '
                    '"0.0.0.0:5556"')
    sandbox = raw.get("sandbox", {})
    _check_keys(path, "sandbox", sandbox, {"tier_min", "allow_unsandboxed", "network", "limits",
                                           "mode", "git_writable"})
    mode = _typed(path, "sandbox", sandbox, "mode", str, "workspace-write")
    if mode not in ("workspace-write", "read-only"):
        raise _fail(path, "sandbox.mode", 'must be "workspace-write" or "read-only"')
    limits = _table(path, "sandbox.limits", sandbox.get("limits", {}))
    _check_keys(path, "sandbox.limits", limits, _LIMIT_KEYS)
    for key in limits:
        value = _typed(path, "sandbox.limits", limits, key, (int, float), None)
        if value is not None and value < 0:
            raise _fail(path, f"sandbox.limits.{key}", "must not be negative")
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
    if not isinstance(sinks, list):
        raise _fail(path, "export.sinks", "must be a list of tables ([[export.sinks]])")
    for i, sink in enumerate(sinks):
        if not isinstance(sink, dict) or sink.get("type") not in ("directory", "http"):
            raise _fail(path, f"export.sinks[{i}]", "needs type = \"directory\" or \"http\"")
    try:
        mcp = parse_mcp_servers(raw.get("mcp", {}))
        command_tools = parse_command_tools(raw.get("tools", {}))
    except SpecError as exc:  # "[mcp.NAME] ...": its table's line is named
        where = re.match(r"\[([^\]]+)\]", str(exc))
        raise ConfigError(f"{path}: {exc}", key=where.group(1) if where else None) from None
    telemetry = raw.get("telemetry", {})
    _check_keys(path, "telemetry", telemetry, {"metrics_listen", "otlp_endpoint",
                                               "record_content"})
    metrics_listen = _typed(path, "telemetry", telemetry, "metrics_listen", str, None)
    if metrics_listen is not None and not _HOST_PORT.fullmatch(metrics_listen):
        raise _fail(path, "telemetry.metrics_listen", 'must be "HOST:PORT", e.g. '
                    '"127.0.0.1:9464"')
    otlp = _typed(path, "telemetry", telemetry, "otlp_endpoint", str, None)
    if otlp is not None and not re.fullmatch(r"https?://\S+", otlp):
        raise _fail(path, "telemetry.otlp_endpoint", 'must be an http(s) URL, e.g. '
                    '"http://127.0.0.1:4318"')
    web = raw.get("web", {})
    _check_keys(path, "web", web, {"listen"})
    web_listen = _typed(path, "web", web, "listen", str, None)
    if web_listen is not None and not _HOST_PORT.fullmatch(web_listen):
        raise _fail(path, "web.listen", 'must be "HOST:PORT", e.g. "127.0.0.1:8765"')
    store_url, store_lease_s = parse_store(path, raw.get("store", {}))
    workers = _typed(path, "farm", farm, "workers", int, None)
    if workers is not None and not 0 <= workers <= 256:
        raise _fail(path, "farm.workers", "must be between 0 (remote workers only) and 256")
    return FarmConfig(
        home=home,
        workers=workers,
        mcp=mcp,
        command_tools=command_tools,
        heartbeat_interval_s=float(_above_zero(path, "farm", farm, "heartbeat_interval_s",
                                          (int, float), 0.25)),
        liveness=_above_zero(path, "farm", farm, "liveness", int, 4, least=1),
        backend_tcp=backend_tcp,
        brokers=farm_brokers(path, farm),
        supervisors=farm_supervisors(path, _typed(path, "farm", farm, "supervisors", int, 1),
                                     store_url),
        broker_lists=farm_broker_lists(path, farm),
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
        max_model_steps=_above_zero(path, "session", session, "max_model_steps", int, 256,
                                    least=1),
        turn_timeout_s=float(_above_zero(path, "session", session, "turn_timeout_s",
                                    (int, float), 1800.0)),
        approval_timeout_s=float(_typed(path, "session", session, "approval_timeout_s",
                                        (int, float), 0.0)),
        model_call_budget_s=float(_above_zero(path, "session", session, "model_call_budget_s",
                                         (int, float), 300.0)),
        tool_call_budget_s=float(_above_zero(path, "session", session, "tool_call_budget_s",
                                        (int, float), 600.0)),
        compaction_threshold_tokens=_above_zero(path, "session", session,
                                           "compaction_threshold_tokens", int, 100_000),
        instructions=_typed(path, "session", session, "instructions", str,
                            FarmConfig.instructions),
        routes=routes,
        export_sinks=tuple(sinks),
        metrics_listen=metrics_listen,
        otlp_endpoint=otlp,
        record_content=_typed(path, "telemetry", telemetry, "record_content", bool, False),
        web_listen=web_listen,
        store_url=store_url,
        store_lease_s=store_lease_s,
        store_outage_s=parse_store_outage(path, raw.get("store", {})),
        hooks=parse_hooks(path, raw.get("hooks", {})),
    )


# The first config's route: a provider whose key is in the environment, else the
# scripted demo (so the README's first run works on a machine without any key).
_KEY_ROUTES = (
    ("ANTHROPIC_API_KEY", "anthropic", "claude-sonnet-4-5", "https://api.anthropic.com"),
    ("OPENAI_API_KEY", "openai-responses", "gpt-5-mini", "https://api.openai.com/v1"),
)
DEMO_SCRIPT = "demo-script.json"
_DEMO_TEXT = ("This is Corral's scripted demo model, not a real LLM: it listed the workspace "
              "with the list_dir tool (above) and answers every prompt the same way. For real "
              "answers put an API key in the environment (OPENAI_API_KEY or "
              "ANTHROPIC_API_KEY) and a [routes.main] in {config}; see the comments there.")


def first_route(env: Mapping[str, str]) -> tuple[str, str]:
    """The ``[routes.main]`` table of a first config and a one-line description."""
    for var, provider, model, base_url in _KEY_ROUTES:
        if env.get(var):
            return (f'[routes.main]                 # chosen by corral init: {var} is set\n'
                    f'provider = "{provider}"\nmodel = "{model}"              '
                    f'# any model of this provider\nbase_url = "{base_url}"\n'
                    f'credential_env = "{var}"       # the workers read the key from here\n',
                    f"{provider} {model} (the key comes from ${var})")
    return ('[routes.main]                 # chosen by corral init: no provider key was set\n'
            f'script = "{DEMO_SCRIPT}"     # the scripted demo model (no network, no key)\n',
            "the scripted demo model (no provider key in the environment)")


def demo_script(config_path: Path) -> dict[str, Any]:
    """The demo route's script: each turn lists the workspace, then says what it is
    (entries are picked by the number of model outputs so far: 2 per turn)."""
    turn = [{"tool_calls": [{"name": "list_dir", "arguments": {"path": "."}}],
             "usage": {"input": 40, "output": 8}},
            {"text": _DEMO_TEXT.format(config=config_path), "usage": {"input": 60, "output": 60}}]
    return {"responses": turn * 50}


def write_default(home: Path, env: Mapping[str, str] | None = None) -> tuple[Path, str | None]:
    """Write the commented default config, with a working ``[routes.main]``, unless
    one exists (``corral init``, and the first ``up`` or ``run``). Returns its path
    and, when it was written now, a description of the route it chose."""
    home.mkdir(parents=True, exist_ok=True)
    path = home / "corral.toml"
    if path.exists():
        return path, None
    route, said = first_route(os.environ if env is None else env)
    if "script" in route:
        script = home / DEMO_SCRIPT
        if not script.exists():
            script.write_text(json.dumps(demo_script(path), indent=1) + "\n")
    tmp = path.with_name(".corral.toml.tmp")
    tmp.write_text(DEFAULT_CONFIG + "\n" + route)
    os.replace(tmp, path)
    return path, said


MAX_FARM_BROKERS = 4


def farm_brokers(path: Path, farm: dict[str, Any]) -> int:
    """``[farm] brokers``: how many broker processes the farm runs (1..4)."""
    n = _typed(path, "farm", farm, "brokers", int, 1)
    if not 1 <= n <= MAX_FARM_BROKERS:
        raise _fail(path, "farm.brokers", f"must be between 1 and {MAX_FARM_BROKERS}")
    return int(n)


MAX_BROKER_ENDPOINTS = 8  # a worker serves at most 8 brokers (sandbox_worker.main)
_ENDPOINT = re.compile(r"(tcp://[\w.\-\[\]:]+:\d{1,5}|ipc:///\S+)")


def farm_broker_lists(path: Path, farm: dict[str, Any]) -> tuple[tuple[str, ...],
                                                                 tuple[str, ...]]:
    """``[farm] broker_frontends`` / ``broker_backends``: the brokers of a farm this host
    joins (docs/multihost.md): the frontends a supervisor started here calls (``python -m
    supervisor`` without ``--broker``), the backends a worker started here registers with
    (``corral worker`` without ``--broker``). Each a list of 1..8 distinct endpoints,
    ``tcp://HOST:PORT`` or ``ipc:///PATH``; absent: empty (give ``--broker``)."""
    out = []
    for key in ("broker_frontends", "broker_backends"):
        value = _typed(path, "farm", farm, key, list, [])
        where = f"farm.{key}"
        if not value:
            if key in farm:
                raise _fail(path, where, "must list at least one endpoint, e.g. "
                            '["tcp://broker1:5555", "tcp://broker2:5555"]')
            out.append(())
            continue
        if len(value) > MAX_BROKER_ENDPOINTS:
            raise _fail(path, where, f"lists {len(value)} endpoints; at most "
                        f"{MAX_BROKER_ENDPOINTS}")
        for ep in value:
            if not isinstance(ep, str) or not _ENDPOINT.fullmatch(ep):
                raise _fail(path, where, f"{ep!r} is not an endpoint: give "
                            '"tcp://HOST:PORT" or "ipc:///PATH"')
            why = endpoints.problem(ep, bind=False)
            if why is not None:
                raise _fail(path, where, why)
        if len(set(value)) != len(value):
            dup = next(ep for ep in value if value.count(ep) > 1)
            raise _fail(path, where, f"lists {dup!r} twice")
        out.append(tuple(value))
    return out[0], out[1]


MAX_FARM_SUPERVISORS = 8


def farm_supervisors(path: Path, n: int, store_url: str | None) -> int:
    """``[farm] supervisors`` / ``corral up --supervisors N``: how many supervisor
    processes the farm runs (1..8). More than one share the sessions through leases,
    which only the PostgreSQL store has: SQLite (one writer per file) refuses it."""
    if not 1 <= n <= MAX_FARM_SUPERVISORS:
        raise _fail(path, "farm.supervisors", f"must be between 1 and {MAX_FARM_SUPERVISORS}")
    if n > 1 and store_url is None:
        raise _fail(path, "farm.supervisors",
                    f"{n} supervisors need a shared PostgreSQL store; add to {path}:\n"
                    '  [store]\n  url = "postgresql://USER@HOST:PORT/DATABASE"\n'
                    "then run: corral store migrate (docs/multihost.md)")
    return int(n)
