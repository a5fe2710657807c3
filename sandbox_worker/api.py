"""Public payload schemas of the worker services: ``tool`` and ``model``.

This is the one module of ``sandbox_worker`` that the supervisor may import.
It holds plain msgpack-friendly ``TypedDict`` shapes and constants, nothing
that runs. Payloads travel as the opaque body of broker REQUEST, PARTIAL and
REPLY messages (``broker.protocol.pack``).

Conversation items are Responses-style dicts (the supervisor's neutral form):

- ``{"type": "message", "role": "user"|"assistant"|"system"|"developer",
  "content": [ContentPart, ...]}``
- ``{"type": "function_call", "call_id", "name", "arguments": <json string>}``
- ``{"type": "function_call_output", "call_id", "output": str, "is_error"?: bool}``
- ``{"type": "reasoning", "text": str}``
- ``{"type": "compaction", "summary"?: str, "encrypted_content"?: str}``

Any item may carry ``"corral": {...}`` metadata (for example
``{"kind": "pre_tool_hook"}`` or ``{"cache_breakpoint": true}``); adapters use
what they understand and never send the ``corral`` key to a provider.

Invariants:
- API keys never appear in any shape here. A route names a credential
  (an environment variable name on the worker), never its value.
- Every size that can grow (output, items, arguments) is bounded by the
  worker and reported (``truncated``) rather than silently cut.
- One source of truth for sizes that reach the supervisor's store: the store
  bounds an item at ``STORE_ITEM_BYTES`` of encoded JSON (``json_text``), and a
  tool result's ``output`` is at most ``TOOL_OUTPUT_BYTES`` as a JSON string
  (quotes and escapes counted), which leaves ``ITEM_ENVELOPE_BYTES`` for the
  item's other fields. Both sides measure with ``json_text``, so no encoding
  overhead (escapes, U+FFFD, lone surrogates) can make them disagree.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from typing import Any, Final, Literal, NotRequired, TypeAlias, TypedDict

# The environment variables a model route's key is read from by default (a route's
# credential_env names another): the generic one, then the provider's own.
GENERIC_ENV: Final = "CORRAL_API_KEY"
PROVIDER_ENV: Final = {"openai-responses": "OPENAI_API_KEY", "openai-chat": "OPENAI_API_KEY",
                       "anthropic": "ANTHROPIC_API_KEY"}
SERVICE_TOOL: Final = "tool"
SERVICE_MODEL: Final = "model"

# --------------------------------------------------------------------------
# Sizes and text encoding: one source of truth for the worker and the store
# --------------------------------------------------------------------------

# The store's bounds on one transcript item and one event payload, in bytes of
# the compact UTF-8 JSON it writes (``json_text``); ``supervisor.store.codec``
# takes its defaults from here.
STORE_ITEM_BYTES: Final = 1 << 20
STORE_PAYLOAD_BYTES: Final = 1 << 20
# What a ``function_call_output`` item holds besides its output: the type, a
# call_id of at most MAX_CALL_ID_CHARS (6 bytes each at worst), ``is_error``.
ITEM_ENVELOPE_BYTES: Final = 4 << 10
# The bound on ``ToolCallResult.output`` as a JSON string, quotes included.
TOOL_OUTPUT_BYTES: Final = STORE_ITEM_BYTES - ITEM_ENVELOPE_BYTES
MAX_CALL_ID_CHARS: Final = 256
# Lone surrogates (from os.fsdecode of a non-UTF-8 name, or a JSON "\ud800"
# escape) cannot be encoded as UTF-8.
SURROGATES: Final = re.compile("[\ud800-\udfff]")
_COMPACT: Final = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False,
                                   allow_nan=False)
_SORTED: Final = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False,
                                  allow_nan=False, sort_keys=True)


def _escape_surrogate(m: re.Match[str]) -> str:
    return f"\\u{ord(m.group()):04x}"


def json_text(value: Any, *, sort_keys: bool = False) -> tuple[str, int]:
    """Compact JSON of ``value`` as the store writes it, and its UTF-8 size.

    Non-ASCII is kept; a lone surrogate (which UTF-8 cannot carry) is written
    as its ``\\uXXXX`` escape, so the text is always valid UTF-8 and reads back
    as the same string. NaN and infinities raise ``ValueError``; values that
    are not JSON raise ``TypeError``."""
    text = (_SORTED if sort_keys else _COMPACT).encode(value)
    try:
        return text, len(text.encode("utf-8"))
    except UnicodeEncodeError:
        text = SURROGATES.sub(_escape_surrogate, text)
        return text, len(text.encode("utf-8"))


def json_size(value: Any) -> int:
    """Bytes of ``value`` as the store writes it (``json_text``)."""
    return json_text(value)[1]


# Long texts are measured and cleaned in chunks of this many characters: each
# chunk is one short C call, so a thread cutting a 50 MB tool result lets the
# event loop's thread take the GIL between chunks (one call over the whole text
# held it for the whole pass: a program's heartbeats stopped while it cut one).
# Exact: a JSON escape and a lone surrogate are each one code point.
_CHUNK: Final = 1 << 15


def replace_surrogates(text: str) -> str:
    """``text`` with each lone surrogate replaced by U+FFFD (for model text)."""
    if len(text) <= _CHUNK:
        return SURROGATES.sub("\ufffd", text)
    return "".join(SURROGATES.sub("\ufffd", text[at: at + _CHUNK])
                   for at in range(0, len(text), _CHUNK))


def _body_size(text: str) -> int:
    """Bytes of ``text`` inside a JSON string as ``json_text`` writes it (no quotes)."""
    enc = _COMPACT.encode(text)
    try:
        return len(enc.encode("utf-8")) - 2
    except UnicodeEncodeError:  # a lone surrogate: 3 bytes in surrogatepass, 6 escaped
        return len(enc.encode("utf-8", "surrogatepass")) - 2 + 3 * len(SURROGATES.findall(enc))



def _prefix_within(text: str, room: int) -> str:
    """The longest prefix of ``text`` whose JSON body is at most ``room`` bytes.
    The body size is additive over characters, so whole chunks are summed and
    only the chunk where the room runs out is bisected: O(n) in C."""
    used = 0
    at = 0
    while at < len(text):
        chunk = text[at: at + _CHUNK]
        size = _body_size(chunk)
        if used + size > room:
            lo, hi = 0, len(chunk)  # lo fits, hi does not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if used + _body_size(chunk[:mid]) <= room:
                    lo = mid
                else:
                    hi = mid
            return text[: at + lo]
        used += size
        at += len(chunk)
    return text


def fit_text(text: str, max_bytes: int, marker: str) -> tuple[str, bool]:
    """``text``, or its longest prefix followed by ``marker``, such that the
    result as a JSON string (``json_size``, quotes and escapes counted) is at
    most ``max_bytes``. Returns (text, cut). ``marker`` may hold ``{shown}``
    and ``{total}`` (bytes of JSON text shown and in all); if even the marker
    does not fit, the result is the marker's longest prefix that does."""
    total = sum(_body_size(text[at: at + _CHUNK]) for at in range(0, len(text), _CHUNK))
    if total + 2 <= max_bytes:
        return text, False
    # The marker at its longest (shown <= total): the room left for the head.
    room = max_bytes - 2 - _body_size(marker.format(shown=total, total=total))
    head = _prefix_within(text, room) if room > 0 else ""
    out = head + marker.format(shown=_body_size(head), total=total)
    if _body_size(out) + 2 > max_bytes:
        out = _prefix_within(out, max(0, max_bytes - 2))
    return out, True


# --------------------------------------------------------------------------
# Tool service
# --------------------------------------------------------------------------

TOOL_NAMES: Final = ("shell", "read_file", "write_file", "edit_file", "list_dir")
# Tools whose effect may be repeated safely; only these are retried after a
# worker is lost mid-call. Everything else becomes outcome "unknown".
IDEMPOTENT_TOOLS: Final = frozenset({"read_file", "list_dir"})
# Tools that cannot change the workspace; approval policies may allow them by default.
READ_ONLY_TOOLS: Final = frozenset({"read_file", "list_dir"})

Tier: TypeAlias = Literal["T0", "T1", "T2-", "T2"]
TIER_ORDER: Final[dict[str, int]] = {"T0": 0, "T1": 1, "T2-": 2, "T2": 3}


def worker_cgroup_dirs(worker_pid: int, root: str = "/sys/fs/cgroup") -> tuple[str, ...]:
    """Where worker ``worker_pid`` keeps every process of its tool calls: its
    cgroups, ``corral/worker-<pid>`` under the v1 ``pids`` and ``memory``
    hierarchies or the v2 root (``sandbox/cgroup.py``; the worker removes them
    on a clean exit). A process listed in their ``cgroup.procs`` after the
    worker is gone is a tool process that outlived it."""
    name = f"corral/worker-{worker_pid}"
    return (f"{root}/pids/{name}", f"{root}/memory/{name}", f"{root}/{name}")


class ToolLimits(TypedDict, total=False):
    wall_s: float  # wall-clock time of the call
    cpu_s: int  # RLIMIT_CPU
    address_space_bytes: int  # RLIMIT_AS
    processes: int  # RLIMIT_NPROC (per sandbox uid)
    file_size_bytes: int  # RLIMIT_FSIZE
    open_files: int  # RLIMIT_NOFILE
    output_bytes: int  # cap per stream (stdout, stderr); the call is killed at the cap
    tmpfs_bytes: int  # size of the private /tmp


SandboxMode: TypeAlias = Literal["read-only", "workspace-write"]
SANDBOX_MODES: Final = ("read-only", "workspace-write")


class ToolPolicy(TypedDict, total=False):
    network: bool  # a grant: the call runs without a network namespace
    tier_min: Tier  # refuse below this tier
    allow_unsandboxed: bool  # operator opt-in to T0; recorded on every result
    limits: ToolLimits
    sandbox_mode: SandboxMode  # default "workspace-write"; "read-only" binds it read-only
    git_writable: bool  # opt-in: .git in the workspace is writable (default: read-only)
    # The session's image (docs/images.md): "sha256:HEX", its manifest digest,
    # resolved when the session was created. Tool calls run over its root.
    image: str


# --------------------------------------------------------------------------
# Images (docs/images.md): what the store and the workers agree on
# --------------------------------------------------------------------------

IMAGE_DIGEST_RE: Final = re.compile(r"sha256:[0-9a-f]{64}")
# A worker serves ``tool@img-<the digest's first 48 hex>`` for each image it
# holds (at most IMAGE_SERVICES of them; READY takes names of at most 64
# characters, and the worker checks the full digest anyway): a call of a
# session in that image is sent there first, and to ``tool`` when no worker
# serves the name.
IMAGE_SERVICE_PREFIX: Final = "tool@img-"
IMAGE_SERVICES: Final = 48


def image_service(digest: str) -> str:
    """The service name of the workers holding image ``digest`` (sha256:HEX)."""
    return IMAGE_SERVICE_PREFIX + digest.removeprefix("sha256:")[:48]


class ImageRecord(TypedDict):
    """The image a call ran over, as the worker's disk showed it: the digest
    of the manifest it read and hashed, and the digest of the root tree it
    bound (``rootfs_sha256``, checked against the store's record of it)."""

    digest: str
    rootfs_sha256: str
    workdir: str  # where the workspace was bound
    user: str  # the image's User (its name or uid), "" when none
    # "per-call": a call's own layer; "per-server": an MCP stdio server's,
    # which lasts as long as that server's process.
    writable_layer: Literal["per-call", "per-server"]


class ToolCallRequest(TypedDict):
    """Body of a ``tool`` REQUEST."""

    call_id: str
    tool: str
    arguments: dict[str, Any]
    session_id: str
    workspace: str  # absolute path on the worker host
    policy: NotRequired[ToolPolicy]
    # (st_dev, st_ino) of the workspace when its session was created, seen on
    # host ``workspace_host``; a worker on that host refuses a workspace that is
    # no longer that directory (one on another host, whose device numbers
    # differ, pins what it sees at the session's first call there).
    workspace_identity: NotRequired[list[int]]
    workspace_host: NotRequired[str]
    command_tool: NotRequired[CommandToolSpec]  # a [tools.NAME] call
    mcp: NotRequired[McpCall]  # an MCP server's list or call


# --------------------------------------------------------------------------
# Tools from outside: command tools and MCP servers (docs/tools.md)
# --------------------------------------------------------------------------

MCP_PREFIX: Final = "mcp__"  # an MCP tool is offered as mcp__SERVER__TOOL
# A name the model may call: what providers accept for a function name.
TOOL_NAME_RE: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")
# The worker that holds a session's MCP server also serves ``tool@PIN``: calls
# after the first are sent there (``ToolCallResult.pin``).
PIN_SEP: Final = "@"
# An HTTP MCP server's headers may name only worker variables with this prefix:
# a session's spec must not be able to send, say, a provider's API key to a
# server of its choosing.
MCP_HEADER_ENV_PREFIX: Final = "CORRAL_MCP_"


class CommandToolSpec(TypedDict):
    """A ``[tools.NAME]`` command tool: its arguments as JSON on stdin, its
    stdout the result, a non-zero exit an error result."""

    description: str
    parameters: dict[str, Any]  # a JSON Schema of the arguments (an object)
    command: list[str]
    idempotent: bool
    read_only: bool


class McpServerSpec(TypedDict, total=False):
    """A ``[mcp.NAME]`` server: ``command`` (stdio, run in the sandbox) or
    ``url`` (streamable HTTP, called from the worker)."""

    command: list[str]
    env: dict[str, str]
    cwd: str  # relative to the workspace
    network: bool  # stdio: the server's sandbox gets the network
    url: str
    headers_env: dict[str, str]  # HTTP header -> env var on the worker holding its value
    start_timeout_s: float  # initialize + tools/list must answer within it (default 30 s)


class McpCall(TypedDict):
    """What a ``tool`` REQUEST for an MCP server carries besides its arguments:
    ``op`` "list" starts the server (if needed) and answers its tools in
    ``ToolCallResult.mcp_tools``; "call" calls ``tool`` on it."""

    server: str
    spec: McpServerSpec
    op: Literal["list", "call"]
    tool: str  # the server's own tool name ("" for list)


class McpToolInfo(TypedDict):
    """One tool a server declares, as listed (``ToolCallResult.mcp_tools``)."""

    name: str
    description: str
    input_schema: dict[str, Any]
    read_only: bool  # annotations.readOnlyHint
    idempotent: bool  # annotations.idempotentHint


class ToolOutputChunk(TypedDict):
    """Body of a ``tool`` PARTIAL: output while the command runs."""

    stream: Literal["stdout", "stderr"]
    data: bytes


class KernelFacts(TypedDict):
    """What the kernel showed a probe at the end of the same argv chain
    (``sandbox/verify.py``): the evidence an isolation record is derived from."""

    seccomp_mode: int  # /proc/self/status Seccomp: 0 none, 2 filter
    no_new_privs: bool  # NoNewPrivs
    uids: list[int]  # Uid: real, effective, saved, fs (the probe's own uid shown as the call's)
    gids: list[int]  # Gid
    cap_eff: str | None  # CapEff (hex); None when /proc is not mounted (T2-)
    namespaces: list[str]  # namespaces separate from the worker's (/proc/self/ns/*)
    denied: list[str]  # probes refused: unshare, socket_vsock, socket_inet, host_write


class IsolationRecord(TypedDict):
    """What isolation a call really ran under. Attached to every result."""

    tier: Tier
    filesystem: str  # e.g. "ro-system+rw-workspace", "workspace-openat2", "host"
    network: Literal["none", "granted", "host"]
    pid_namespace: bool
    seccomp: bool
    uid: int
    limits: ToolLimits
    degraded: list[str]  # human-readable reasons, empty when nothing is degraded
    unsandboxed_opt_in: bool
    kernel: KernelFacts | None  # what the chain's probe saw; None: file tools, not probed
    sandbox_mode: NotRequired[SandboxMode]  # how the workspace was bound for this call
    git_writable: NotRequired[bool]  # whether .git in the workspace was writable
    image: NotRequired[ImageRecord]  # the image root the call ran over (none: the host's)


ToolOutcome: TypeAlias = Literal["ok", "error", "timeout", "cancelled"]


class ToolCallResult(TypedDict):
    """Body of a ``tool`` REPLY. Tool errors are results, not broker failures."""

    call_id: str
    tool: str
    outcome: ToolOutcome
    is_error: bool
    output: str  # what the model reads
    exit_code: int | None
    signal: int | None
    duration_s: float
    stdout_bytes: int
    stderr_bytes: int
    truncated: bool
    isolation: IsolationRecord
    error_kind: NotRequired[str]  # e.g. "bad_arguments", "unknown_tool", "outside_workspace"
    pin: NotRequired[str]  # MCP: the service of the worker that holds the server
    mcp_tools: NotRequired[list[McpToolInfo]]  # MCP op "list"


class ToolSchema(TypedDict):
    """A tool as published to the model (JSON schema of its arguments)."""

    name: str
    description: str
    parameters: dict[str, Any]
    idempotent: bool
    read_only: bool


# --------------------------------------------------------------------------
# Model service
# --------------------------------------------------------------------------

Provider: TypeAlias = Literal["openai-responses", "openai-chat", "anthropic"]
PROVIDERS: Final = ("openai-responses", "openai-chat", "anthropic")
Item: TypeAlias = dict[str, Any]


class ModelRoute(TypedDict):
    """A resolved model route. Carries a credential *name*, never a key."""

    name: str  # the route's name in the config, e.g. "main" or "alternate"
    provider: Provider
    model: str
    base_url: str
    credential_env: NotRequired[str]  # env var on the worker holding the key
    native_compaction: NotRequired[bool]  # the provider has a compaction endpoint
    context_window: NotRequired[int]
    max_output_tokens: NotRequired[int]
    connect_timeout_s: NotRequired[float]
    read_timeout_s: NotRequired[float]
    max_retries: NotRequired[int]
    script: NotRequired[str]  # a scripted provider: path of its script (see docs/models.md)


class ModelCallRequest(TypedDict):
    """Body of a ``model`` REQUEST."""

    op: Literal["respond", "compact"]
    route: ModelRoute
    instructions: str  # the system prompt
    items: list[Item]
    tools: list[ToolSchema]
    stream: bool
    session_id: str
    prompt_cache_key: NotRequired[str]


class Usage(TypedDict):
    input: int
    cached_input: int
    cache_write_input: int
    output: int
    reasoning_output: int
    total: int


def empty_usage() -> Usage:
    return Usage(
        input=0, cached_input=0, cache_write_input=0, output=0, reasoning_output=0, total=0
    )


def add_usage(a: Usage, b: Usage) -> Usage:
    return Usage(
        input=a["input"] + b["input"],
        cached_input=a["cached_input"] + b["cached_input"],
        cache_write_input=a["cache_write_input"] + b["cache_write_input"],
        output=a["output"] + b["output"],
        reasoning_output=a["reasoning_output"] + b["reasoning_output"],
        total=a["total"] + b["total"],
    )


ModelDeltaType: TypeAlias = Literal[
    "text_delta",  # {"text"}
    "reasoning_delta",  # {"text"}
    "tool_call_delta",  # {"index", "call_id"?, "name"?, "arguments_delta"}
    "retry",  # {"attempt", "kind", "message", "delay_s", "discard_partial": bool}
]


class ModelDelta(TypedDict):
    """Body of a ``model`` PARTIAL. ``retry`` with ``discard_partial`` tells the
    supervisor to drop the deltas relayed so far for this request."""

    type: ModelDeltaType
    text: NotRequired[str]
    index: NotRequired[int]
    call_id: NotRequired[str]
    name: NotRequired[str]
    arguments_delta: NotRequired[str]
    attempt: NotRequired[int]
    kind: NotRequired[str]
    message: NotRequired[str]
    delay_s: NotRequired[float]
    discard_partial: NotRequired[bool]


StopReason: TypeAlias = Literal["end_turn", "tool_calls", "max_tokens", "content_filter", "other"]


class ModelCallResult(TypedDict):
    """Body of a ``model`` REPLY: one provider-neutral output."""

    items: list[Item]  # assistant messages, reasoning, function calls, or a compaction item
    stop_reason: StopReason
    usage: Usage
    provider: Provider
    model: str
    retries: int


class MalformedResult(ValueError):
    """A service REPLY body that is not the shape this module declares."""


class MalformedRequest(ValueError):
    """A service REQUEST body that is not the shape this module declares."""


_REQUEST_STRINGS: Final = ("call_id", "tool", "session_id", "workspace")


def decode_tool_request(body: Any) -> ToolCallRequest:
    """The one check of a ``tool`` REQUEST body (already unpacked), for the tool
    service and for anyone who builds or relays one: a map; ``call_id``,
    ``tool``, ``session_id`` and ``workspace`` strings; ``arguments`` present;
    ``workspace_identity``, when given, two non-negative integers (a pin that
    cannot be read is refused, never ignored); ``workspace_host`` a string.
    Raises ``MalformedRequest`` naming the field. What the arguments and the
    policy *mean* (the tool's schema, the tier, the mode) is the tool service's
    to judge, and a result the model reads, not a malformed request."""
    if not isinstance(body, dict):
        raise MalformedRequest("tool request must be a map")
    for key in _REQUEST_STRINGS:
        if not isinstance(body.get(key), str):
            raise MalformedRequest(f"tool request field {key!r} must be a string")
    if "arguments" not in body:
        raise MalformedRequest("tool request lacks 'arguments'")
    identity = body.get("workspace_identity")
    if identity is not None and not (
            isinstance(identity, list | tuple) and len(identity) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                    for v in identity)):
        raise MalformedRequest("tool request field 'workspace_identity' must be two "
                               "non-negative integers (st_dev, st_ino)")
    if not isinstance(body.get("workspace_host", ""), str):
        raise MalformedRequest("tool request field 'workspace_host' must be a string")
    return body  # type: ignore[return-value]


def decode_model_result(body: Any) -> ModelCallResult:
    """The one check of a ``model`` REPLY body (already unpacked): ``items`` a
    list of maps, ``usage`` a map of integer counters (absent ones are 0).
    Returns the typed result with its usage normalised; raises
    ``MalformedResult`` saying what is wrong."""
    if not isinstance(body, dict) or not isinstance(body.get("items"), list) \
            or not all(isinstance(i, dict) for i in body["items"]) \
            or not isinstance(body.get("usage"), dict):
        raise MalformedResult("the model service answered with a malformed result")
    given = body["usage"]
    usage = empty_usage()
    for k in usage:
        v = given.get(k, 0)
        if not isinstance(v, int) or isinstance(v, bool):
            raise MalformedResult(f"model usage field {k!r} is not an integer")
        usage[k] = v  # type: ignore[literal-required]
    return {**body, "usage": usage}  # type: ignore[typeddict-item]


def decode_tool_result(body: Any) -> ToolCallResult:
    """The one check of a ``tool`` REPLY body (already unpacked): the fields the
    supervisor reads (``output`` a string, ``is_error`` a boolean, ``isolation``
    a map when present). Raises ``MalformedResult``."""
    if not isinstance(body, dict) or not isinstance(body.get("output"), str):
        raise MalformedResult("the tool service answered with a malformed result")
    if not isinstance(body.get("is_error", False), bool):
        raise MalformedResult("tool result field 'is_error' is not a boolean")
    if not isinstance(body.get("isolation", {}), dict | type(None)):
        raise MalformedResult("tool result field 'isolation' is not a map")
    return body  # type: ignore[return-value]


# Failure kinds of the model service (sent as broker FAILURE kind strings).
MODEL_FAILURE_AUTH: Final = "auth"  # not retryable
MODEL_FAILURE_BAD_REQUEST: Final = "bad_request"  # not retryable
MODEL_FAILURE_RATE_LIMITED: Final = "rate_limited"  # retryable
MODEL_FAILURE_SERVER: Final = "server_error"  # retryable
MODEL_FAILURE_CONNECT: Final = "connect_error"  # retryable
MODEL_FAILURE_TIMEOUT: Final = "timeout"  # retryable
MODEL_FAILURE_STREAM: Final = "stream_error"  # retryable: malformed or truncated stream


# --------------------------------------------------------------------------
# Route parsing (pure: the supervisor and the CLI use it)
# --------------------------------------------------------------------------

DEFAULT_BASE_URLS: Final[dict[str, str]] = {
    "openai-responses": "https://api.openai.com/v1",
    "openai-chat": "https://api.openai.com/v1",
    "anthropic": "https://api.anthropic.com",
}
SCRIPT_PREFIX: Final = "script:"


def parse_route(spec: str, base_url: str | None = None, *, name: str = "main") -> ModelRoute:
    """Parse ``PROVIDER:MODEL`` or ``script:[PROVIDER:]PATH`` into a route.

    ``PROVIDER`` is one of ``PROVIDERS``. A ``script:`` route names a scripted
    provider; its ``base_url`` is left empty unless given, because whoever starts
    the scripted server (``sandbox_worker.fakellm.launch``) learns the URL.
    Raises ``ValueError`` with a readable message on a bad spec.
    """
    spec = spec.strip()
    if spec.startswith(SCRIPT_PREFIX):
        rest = spec[len(SCRIPT_PREFIX):]
        provider: str = "openai-responses"
        head, sep, tail = rest.partition(":")
        if sep and head in PROVIDERS:
            provider, rest = head, tail
        if not rest:
            raise ValueError(f"route {spec!r}: script: needs a path")
        route = ModelRoute(
            name=name, provider=provider, model="scripted",  # type: ignore[typeddict-item]
            base_url=base_url or "", script=rest,
        )
        if provider == "openai-responses":
            route["native_compaction"] = True
        return route
    provider, sep, model = spec.partition(":")
    if not sep or provider not in PROVIDERS or not model:
        raise ValueError(
            f"route {spec!r}: expected PROVIDER:MODEL with PROVIDER one of "
            f"{', '.join(PROVIDERS)}, or script:PATH"
        )
    route = ModelRoute(
        name=name, provider=provider, model=model,  # type: ignore[typeddict-item]
        base_url=(base_url or DEFAULT_BASE_URLS[provider]).rstrip("/"),
    )
    # OpenAI's own Responses API has /responses/compact; compatible servers may not.
    if provider == "openai-responses" and route["base_url"] == DEFAULT_BASE_URLS[provider]:
        route["native_compaction"] = True
    return route


# --------------------------------------------------------------------------
# An image root's tree digest: computed by the store when it installs an
# image (``image.json``'s ``rootfs_sha256``), checked by a worker before it
# binds the root. Pure standard library, so both sides run the same code.
# --------------------------------------------------------------------------

ROOTFS_DIGEST_MAX_DEPTH: Final = 256


def rootfs_digest(root_fd: int) -> str:
    """``sha256:HEX`` over the tree under the directory ``root_fd``: one line
    per entry in sorted path order -- its type (d, f, l), permission bits,
    path, and for a file its size and content sha256, for a symlink its
    target. Links are never followed (every open is ``O_NOFOLLOW`` relative
    to its parent's fd); any other file type raises ``ValueError``."""
    total = hashlib.sha256()

    def walk(dfd: int, prefix: bytes, depth: int) -> None:
        if depth > ROOTFS_DIGEST_MAX_DEPTH:
            raise ValueError(f"{prefix.decode(errors='replace')}: deeper than "
                             f"{ROOTFS_DIGEST_MAX_DEPTH}")
        for name in sorted(os.listdir(dfd)):
            raw = os.fsencode(name)
            path = prefix + b"/" + raw
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            mode = b"%o" % stat.S_IMODE(st.st_mode)
            if stat.S_ISDIR(st.st_mode):
                total.update(b"d " + mode + b" " + path + b"\n")
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                              | os.O_CLOEXEC, dir_fd=dfd)
                try:
                    walk(sub, path, depth + 1)
                finally:
                    os.close(sub)
            elif stat.S_ISLNK(st.st_mode):
                target = os.readlink(name, dir_fd=dfd)
                total.update(b"l " + mode + b" " + path + b" " + os.fsencode(target) + b"\n")
            elif stat.S_ISREG(st.st_mode):
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                try:
                    h = hashlib.sha256()
                    size = 0
                    while data := os.read(fd, 1 << 20):
                        h.update(data)
                        size += len(data)
                finally:
                    os.close(fd)
                total.update(b"f " + mode + b" " + path + b" %d " % size
                             + h.hexdigest().encode() + b"\n")
            else:
                raise ValueError(f"{path.decode(errors='replace')}: not a file, directory "
                                 "or symlink")

    walk(root_fd, b"", 0)
    return "sha256:" + total.hexdigest()
