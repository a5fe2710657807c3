"""The supervisor's client protocol: framing and message shapes.

Clients (``supervisor.client``, the ``corral`` CLI) talk to the supervisor
over one ZeroMQ DEALER → ROUTER connection. Each message is two frames::

    frame 0: b"CORRAL-SESSIONS/1"   protocol name and version
    frame 1: msgpack map            the message

Client → supervisor: ``{"id": int, "call": str, "args": {...}}``. Calls:
``hello``, ``ping``, ``create_session``, ``submit``, ``subscribe``,
``unsubscribe``, ``list_sessions``, ``describe``, ``status``, ``history``,
``export`` (a session's latest portable checkpoint: ``{"checkpoint", "source"}``),
``register_client`` (``{session_id, tools: [names], hooks: bool, liveness_s?}``:
this connection holds the session's client tools and hooks, and is dropped
after ``liveness_s`` of silence) and ``client_result`` (``{id, result}``: the
answer to a pushed ``client_call``: for a tool ``{output, is_error,
error_kind?, truncated?, client: {pid, uid, host}}``, for a hook ``{hook:
{...HookResult fields}}`` or ``{error}``; see ``supervisor/clienttools.py``).

Supervisor → client:
- a call's answer: ``{"id": int, "ok": true, "result": ...}`` or
  ``{"id": int, "ok": false, "error": {"kind", "message"}}``;
- a pushed event: ``{"sub": int, "event": {...EventRecord fields...}}``;
- a subscription's end: ``{"sub": int, "end": {"kind", "message"}}``;
- a heartbeat: ``{"hb": true}``;
- ``{"dropped": {"why"}}``: the server dropped this client (silent past its
  liveness window): its subscriptions and client tool holds are gone;
- a call of a client tool or hook this client holds:
  ``{"client_call": {"id", "session_id", "name", "budget_s", "kind": "tool",
  "call_id", "arguments"}}`` or ``{... "kind": "hook", "input": {...}}``,
  answered with the ``client_result`` call; ``{"client_cancel": {"id"}}``
  when the supervisor gives up on it (interrupt, budget).

Every message from the supervisor also carries ``"srv": instance_id``, a
fresh id per supervisor process, so clients notice a restart at once.

Invariants:
- ``decode`` raises only ``WireError`` for any input, and never asserts.
- Strings are UTF-8 both ways: a lone surrogate is sent as U+FFFD, and a
  message with invalid UTF-8 is refused (``WireError``).
- Error answers carry a kind from ``ErrorKind`` and a message that says what
  to do next; tracebacks stay in the supervisor's log.
"""

from __future__ import annotations

from typing import Any, Final

import msgpack

from broker.protocol import pack

HEADER: Final = b"CORRAL-SESSIONS/1"
MAX_MESSAGE_BYTES: Final = 8 * 1024 * 1024
CALLS: Final = frozenset({
    "hello", "ping", "create_session", "submit", "subscribe", "unsubscribe",
    "list_sessions", "describe", "status", "history", "export", "delete_session",
    "register_client", "client_result",
})


class ErrorKind:
    BAD_REQUEST = "bad_request"  # malformed call or arguments
    UNKNOWN_SESSION = "unknown_session"
    # Another supervisor of the farm owns the session: ask it at the error's "address".
    MOVED = "moved"
    BAD_OP = "bad_op"  # an op the session cannot take
    SLOW_CONSUMER = "slow_consumer"  # subscription dropped; resubscribe from last sequence
    # The session is changing supervisors and nobody has it yet (held, then this):
    # resubscribe from the last sequence after a short wait (docs/multihost.md).
    BETWEEN_OWNERS = "between_owners"
    UNAVAILABLE = "unavailable"  # supervisor shutting down or not ready
    NOT_FOUND = "not_found"  # the thing asked for does not exist (yet), e.g. a checkpoint
    INTERNAL = "internal"
    IMAGE_NOT_FOUND = "image_not_found"  # a session's --image names no image in the store
    IMAGES_UNSUPPORTED = "images_unsupported"  # no registered worker can run image calls


class WireError(Exception):
    """Frames that are not a valid client-protocol message."""


def encode(msg: dict[str, Any]) -> list[bytes]:
    # broker.protocol.pack: strings as UTF-8, a lone surrogate sent as U+FFFD
    # (a CLI argument or a stored value can hold one) instead of failing.
    return [HEADER, pack(msg)]


def decode(frames: list[bytes]) -> dict[str, Any]:
    if len(frames) != 2:
        raise WireError(f"expected 2 frames, got {len(frames)}")
    if frames[0] != HEADER:
        raise WireError(
            f"not a {HEADER.decode()} peer (header {bytes(frames[0][:32])!r}); "
            "check that client and supervisor are the same Corral version"
        )
    if len(frames[1]) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(frames[1])} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        msg = msgpack.unpackb(frames[1], raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises many types; translate at this boundary
        raise WireError(f"message is not valid msgpack: {type(exc).__name__}") from exc
    if not isinstance(msg, dict):
        raise WireError("message must be a map")
    return msg


def parse_call(msg: dict[str, Any]) -> tuple[int, str, dict[str, Any]]:
    """Validate a client call; raises ``WireError`` saying what is wrong."""
    call_id = msg.get("id")
    if not isinstance(call_id, int) or isinstance(call_id, bool) or not 0 <= call_id < 2**62:
        raise WireError("field 'id' must be a non-negative integer")
    call = msg.get("call")
    if not isinstance(call, str) or call not in CALLS:
        raise WireError(f"unknown call {call!r}; expected one of {sorted(CALLS)}")
    args = msg.get("args", {})
    if not isinstance(args, dict):
        raise WireError("field 'args' must be a map")
    return call_id, call, args
