"""The Corral wire protocol: message kinds, framing and the msgpack codec.

This module is the leaf shared by all three processes. It depends on msgpack
and the standard library only, and never on the rest of Corral.

Framing (after any ROUTER identity frame, which the socket layer strips)::

    frame 0: b"CORRAL/1"          protocol name and version
    frame 1: one byte              the message kind (``Kind``)
    frame 2: msgpack map           routing metadata, small, always decoded
    frame 3: bytes (optional)      the opaque application payload

The broker decodes frames 0-2 only; the payload is forwarded untouched, which
keeps its cost independent of the payload and lets the limit on a message be
checked before anything is parsed.

Invariants:
- ``decode`` never raises anything but ``ProtocolError`` subclasses, whatever
  the input; it never asserts.
- ``decode(encode(m)) == m`` for every message ``m`` (property-tested).
- Times on the wire are budgets in seconds (``budget_s``), never timestamps:
  clocks do not cross hosts. One name each, everywhere in Corral: a **budget**
  (``budget_s``) is a duration, what a request may still take, and is what is
  sent; a **deadline** is a local ``time.monotonic()`` instant, ``now +
  budget_s`` on the host that holds it, and is never sent. Each hop (client,
  broker, worker) keeps its own deadline and forwards what is left of it.

Exception tree::

    ProtocolError                 frames that are not a valid Corral message
    ├── VersionMismatch           a peer speaks another protocol or version
    ├── Oversized                 a message larger than the configured limit
    ├── UnknownKind               a kind byte this version does not know
    └── MalformedMessage          missing frames, bad msgpack, bad fields
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Final, TypeAlias

import msgpack

PROTOCOL_NAME: Final = "CORRAL"
PROTOCOL_VERSION: Final = 1
HEADER: Final = f"{PROTOCOL_NAME}/{PROTOCOL_VERSION}".encode()
DEFAULT_MAX_MESSAGE_BYTES: Final = 16 * 1024 * 1024
# Metadata maps are small by construction; a large one is an attack or a bug.
MAX_META_BYTES: Final = 64 * 1024
MAX_ID_CHARS: Final = 256
MAX_TEXT_CHARS: Final = 8192
MAX_CAPACITY: Final = 4096  # a worker's slots (READY, HEARTBEAT)


class ProtocolError(Exception):
    """Frames that do not form a valid Corral message."""


class VersionMismatch(ProtocolError):
    """The peer speaks another protocol, or another version of ours."""


class Oversized(ProtocolError):
    """The message is larger than the receiver's configured limit."""


class UnknownKind(ProtocolError):
    """The kind byte is not one this protocol version defines."""


class MalformedMessage(ProtocolError):
    """Frames are missing, the metadata does not decode, or a field is wrong."""


class Kind(IntEnum):
    """Message kinds. Direction is noted as sender → receiver."""

    READY = 1  # worker → broker: register services and capacity
    HEARTBEAT = 2  # both ways, every peer
    DISCONNECT = 3  # worker/client → broker: leaving; broker → worker: re-register
    REQUEST = 4  # client → broker → worker
    CANCEL = 5  # client → broker → worker
    PARTIAL = 6  # worker → broker → client: a streamed chunk, in order
    REPLY = 7  # worker → broker → client: the final answer
    FAILURE = 8  # worker/broker → client: the final answer, as a failure
    STATUS = 9  # client → broker; answered with REPLY carrying the status map


class FailureKind:
    """Well-known failure kinds. Applications may add their own strings."""

    TIMEOUT = "timeout"  # the request's budget ran out
    WORKER_LOST = "worker_lost"  # the worker died, hung or the broker restarted
    CANCELLED = "cancelled"  # the client cancelled
    OVERLOADED = "overloaded"  # the service's queue is full
    BAD_REQUEST = "bad_request"  # the payload was rejected by the handler
    PROTOCOL = "protocol"  # the peer speaks another protocol version
    INTERNAL = "internal"  # a handler crashed; details stay in its local log
    # A pinned service (NAME@PIN, one worker's own) that no registered worker
    # serves: that worker is gone. Never queued, never dispatched (retryable).
    UNROUTABLE = "unroutable"


# A service name with this separator is one worker's own (``NAME@PIN``): the
# broker never queues a request for it while no registered worker serves it.
PINNED_SEP: Final = "@"


@dataclass(frozen=True, slots=True)
class Failure:
    """The one failure shape of Corral: what went wrong, sent as data.

    ``kind`` is a stable snake_case word (``FailureKind`` or an application's
    own), ``message`` is safe to show (never a traceback or an exception class
    name), ``retryable`` says whether the same request may succeed later.
    Broker FAILUREs, worker handler errors, engine ``error`` events and the
    supervisor's client answers all carry this shape."""

    kind: str
    message: str
    retryable: bool = False

    def as_data(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": self.message, "retryable": self.retryable}


class Failed(Exception):
    """Base of every exception that is a ``Failure``: raised in one place, sent as
    data at a boundary (``exc.failure``), never duck-typed.

    Subclasses set ``kind`` / ``retryable`` as class attributes or per instance.
    ``str(exc)`` is the message unless a subclass says otherwise."""

    kind: str = FailureKind.INTERNAL
    retryable: bool = False

    def __init__(self, message: str, *, kind: str | None = None,
                 retryable: bool | None = None) -> None:
        super().__init__(message)
        self.message = message
        if kind is not None:
            self.kind = kind
        if retryable is not None:
            self.retryable = retryable

    @property
    def failure(self) -> Failure:
        return Failure(self.kind, self.message, self.retryable)


@dataclass(frozen=True, slots=True)
class Ready:
    services: tuple[str, ...]
    capacity: int = 1
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Heartbeat:
    # The sender's instance id. A broker that restarts gets a new one, which is
    # how clients and workers notice a restart faster than by silence.
    peer_id: str = ""
    # Worker → broker only, optional: the worker's slots for this broker from
    # now on (0..4096). A worker serving several brokers shares its slots among
    # them and moves free ones with this (docs/protocol.md, "Several brokers").
    # None (absent on the wire) leaves the capacity of READY unchanged.
    capacity: int | None = None


@dataclass(frozen=True, slots=True)
class Disconnect:
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Request:
    request_id: str
    service: str
    budget_s: float
    body: bytes = b""
    attempt: int = 1


@dataclass(frozen=True, slots=True)
class Cancel:
    request_id: str


@dataclass(frozen=True, slots=True)
class Partial:
    request_id: str
    seq: int
    body: bytes = b""


@dataclass(frozen=True, slots=True)
class Reply:
    request_id: str
    body: bytes = b""


@dataclass(frozen=True, slots=True)
class FailureReply:
    """The FAILURE message: a request's final answer when it failed, carrying one
    ``Failure`` (flat on the wire) and an optional application body."""

    request_id: str
    kind: str
    message: str
    retryable: bool
    body: bytes = b""

    @property
    def failure(self) -> Failure:
        return Failure(self.kind, self.message, self.retryable)


@dataclass(frozen=True, slots=True)
class Status:
    request_id: str


Message: TypeAlias = (
    Ready | Heartbeat | Disconnect | Request | Cancel | Partial | Reply | FailureReply | Status
)


_unpackb: Final = msgpack.unpackb


def pack(obj: Any) -> bytes:
    """Encode an application payload (a msgpack-friendly object).

    Strings go on the wire as UTF-8 (``use_bin_type``: bytes stay bin), and
    ``unpack`` refuses invalid UTF-8 (``MalformedMessage``). A str holding a
    lone surrogate (an ``os.fsdecode``d name, a JSON ``"\\ud800"``) cannot be
    UTF-8: rather than fail the whole message, each one is replaced with
    U+FFFD (``scrub_surrogates``). Producers that need another rendering
    (file names shown escaped) apply it before."""
    try:
        return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]
    except UnicodeEncodeError:
        return msgpack.packb(scrub_surrogates(obj), use_bin_type=True)  # type: ignore[no-any-return]


_SURROGATE: Final = re.compile("[\ud800-\udfff]")


def scrub_surrogates(obj: Any) -> Any:
    """``obj`` with every lone surrogate in its strings (keys too) replaced by
    U+FFFD; containers are copied, other values kept."""
    if isinstance(obj, str):
        return _SURROGATE.sub("\ufffd", obj)
    if isinstance(obj, dict):
        return {scrub_surrogates(k): scrub_surrogates(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [scrub_surrogates(v) for v in obj]
    return obj


def unpack(data: bytes, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Any:
    """Decode an application payload; raises ``MalformedMessage`` on bad bytes."""
    if len(data) > max_bytes:
        raise Oversized(f"payload of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises a zoo of types; translate them here
        raise MalformedMessage(f"payload is not valid msgpack: {type(exc).__name__}") from exc


def _kind_byte(kind: Kind) -> bytes:
    return bytes((kind,))


_KIND_FRAMES: Final = {k: _kind_byte(k) for k in Kind}
_KIND_BY_FRAME: Final = {frame: k for k, frame in _KIND_FRAMES.items()}
# The kind frames of the two messages on the broker's hot path (see broker/server.py).
REQUEST_FRAME: Final = _KIND_FRAMES[Kind.REQUEST]
REPLY_FRAME: Final = _KIND_FRAMES[Kind.REPLY]
_PARTIAL_FRAME: Final = _KIND_FRAMES[Kind.PARTIAL]
_FAILURE_FRAME: Final = _KIND_FRAMES[Kind.FAILURE]
_HEARTBEAT_FRAME: Final = _KIND_FRAMES[Kind.HEARTBEAT]
_CANCEL_FRAME: Final = _KIND_FRAMES[Kind.CANCEL]
_READY_FRAME: Final = _KIND_FRAMES[Kind.READY]
_DISCONNECT_FRAME: Final = _KIND_FRAMES[Kind.DISCONNECT]
_STATUS_FRAME: Final = _KIND_FRAMES[Kind.STATUS]

Pack: TypeAlias = Callable[[Any], bytes]


def request_frames(pack: Pack, request_id: str, service: str, budget_s: float, body: bytes,
                   attempt: int) -> list[bytes]:
    """``encode(Request(request_id, service, budget_s, body, attempt))`` from the
    fields, with the given msgpack ``pack`` (``Encoder.pack``): for a sender that
    has the fields and not the message (the broker's hot path)."""
    meta = {"id": request_id, "svc": service, "b": budget_s, "a": attempt}
    return [HEADER, REQUEST_FRAME, pack(meta), body]


def reply_frames(pack: Pack, request_id: str, body: bytes) -> list[bytes]:
    """``encode(Reply(request_id, body))`` from the fields (see ``request_frames``)."""
    return [HEADER, REPLY_FRAME, pack({"id": request_id}), body]


def _encode_request(m: Request, pack: Pack) -> list[bytes]:
    return request_frames(pack, m.request_id, m.service, m.budget_s, m.body, m.attempt)


def _encode_reply(m: Reply, pack: Pack) -> list[bytes]:
    return reply_frames(pack, m.request_id, m.body)


def _encode_partial(m: Partial, pack: Pack) -> list[bytes]:
    return [HEADER, _PARTIAL_FRAME, pack({"id": m.request_id, "n": m.seq}), m.body]


def _encode_failure(m: FailureReply, pack: Pack) -> list[bytes]:
    meta = {"id": m.request_id, "k": m.kind, "m": m.message, "r": m.retryable}
    return [HEADER, _FAILURE_FRAME, pack(meta), m.body]


def _encode_heartbeat(m: Heartbeat, pack: Pack) -> list[bytes]:
    if m.capacity is None:
        return [HEADER, _HEARTBEAT_FRAME, pack({"p": m.peer_id})]
    return [HEADER, _HEARTBEAT_FRAME, pack({"p": m.peer_id, "c": m.capacity})]


def _encode_cancel(m: Cancel, pack: Pack) -> list[bytes]:
    return [HEADER, _CANCEL_FRAME, pack({"id": m.request_id})]


def _encode_ready(m: Ready, pack: Pack) -> list[bytes]:
    return [HEADER, _READY_FRAME, pack({"s": list(m.services), "c": m.capacity, "i": m.info})]


def _encode_disconnect(m: Disconnect, pack: Pack) -> list[bytes]:
    return [HEADER, _DISCONNECT_FRAME, pack({"r": m.reason})]


def _encode_status(m: Status, pack: Pack) -> list[bytes]:
    return [HEADER, _STATUS_FRAME, pack({"id": m.request_id})]


# One dict lookup on the exact type instead of a chain of class patterns.
_ENCODERS: Final[dict[type, Callable[[Any, Pack], list[bytes]]]] = {
    Request: _encode_request,
    Reply: _encode_reply,
    Partial: _encode_partial,
    FailureReply: _encode_failure,
    Heartbeat: _encode_heartbeat,
    Cancel: _encode_cancel,
    Ready: _encode_ready,
    Disconnect: _encode_disconnect,
    Status: _encode_status,
}


def _encoder(cls: type) -> Callable[[Any, Pack], list[bytes]]:
    for base in cls.__mro__:
        enc = _ENCODERS.get(base)
        if enc is not None:
            return enc
    raise TypeError(f"not a protocol message: {cls.__name__}")


def encode(msg: Message) -> list[bytes]:
    """Encode a message as frames (without any routing identity)."""
    return (_ENCODERS.get(type(msg)) or _encoder(type(msg)))(msg, pack)


class Encoder:
    """``encode`` with a msgpack packer of its own, reused for every message:
    about half the cost of ``msgpack.packb``, which builds a packer per call.

    Not thread-safe (the packer has one buffer): one per thread. The broker's
    single-threaded loop owns one."""

    def __init__(self) -> None:
        self.pack: Pack = msgpack.Packer(use_bin_type=True).pack

    def __call__(self, msg: Message) -> list[bytes]:
        return (_ENCODERS.get(type(msg)) or _encoder(type(msg)))(msg, self.pack)


def check_header(frame: bytes) -> None:
    """Raise ``VersionMismatch`` with a readable reason unless ``frame`` is ours."""
    if frame == HEADER:
        return
    name, _, version = bytes(frame[:64]).partition(b"/")
    if name == PROTOCOL_NAME.encode():
        raise VersionMismatch(
            f"peer speaks {PROTOCOL_NAME} version {version.decode(errors='replace')!r}, "
            f"this side speaks version {PROTOCOL_VERSION}"
        )
    raise VersionMismatch(
        f"not a {PROTOCOL_NAME} peer: header {bytes(frame[:16])!r} (expected {HEADER!r})"
    )


def decode_batch(batch: list[list[bytes]], *, max_bytes: int,
                 dropped: MutableMapping[str, int]) -> Iterator[Message]:
    """Decode each message of a received batch; one that does not decode is
    counted in ``dropped`` under its error's class name and skipped."""
    for frames in batch:
        try:
            yield decode(frames, max_bytes=max_bytes)
        except ProtocolError as exc:
            dropped[type(exc).__name__] = dropped.get(type(exc).__name__, 0) + 1


def decode(
    frames: list[bytes], *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> Message:
    """Decode frames (without routing identity) into a message.

    Raises only ``ProtocolError`` subclasses, for any input.
    """
    if len(frames) < 3 or len(frames) > 4:
        raise MalformedMessage(f"expected 3 or 4 frames, got {len(frames)}")
    total = sum(map(len, frames))
    if total > max_bytes:
        raise Oversized(f"message of {total} bytes exceeds the limit of {max_bytes}")
    if frames[0] != HEADER:
        check_header(frames[0])
    kind_frame = frames[1]
    kind = _KIND_BY_FRAME.get(kind_frame)  # a dict lookup: Kind(...) is slow on the hot path
    if kind is None:
        if len(kind_frame) != 1:
            raise MalformedMessage("kind frame must be exactly one byte")
        raise UnknownKind(f"unknown message kind {kind_frame[0]}")
    meta = _meta(frames[2])
    body = bytes(frames[3]) if len(frames) == 4 else b""
    return _BUILDERS[kind](meta, body)


def _meta(frame: bytes) -> dict[str, Any]:
    if len(frame) > MAX_META_BYTES:
        raise Oversized(f"metadata of {len(frame)} bytes exceeds {MAX_META_BYTES}")
    try:
        meta = _unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:
        raise MalformedMessage(f"metadata is not valid msgpack: {type(exc).__name__}") from exc
    if not isinstance(meta, dict):
        raise MalformedMessage("metadata must be a map")
    return meta


def request_fields(meta: bytes) -> tuple[str, str, float, int]:
    """The checked fields of a REQUEST's metadata frame: (request_id, service,
    budget_s, attempt). For a receiver that routes without building the message
    (the broker); raises ``ProtocolError`` exactly where ``decode`` would."""
    if len(meta) <= MAX_META_BYTES:
        # _meta inlined for the common case: one call less on the broker's hot path.
        try:
            fields = _unpackb(meta, raw=False, strict_map_key=True)
        except Exception:
            fields = None
        if type(fields) is dict:
            return _request_fields(fields)
    return _request_fields(_meta(meta))  # raises the precise error


def reply_id(meta: bytes) -> str:
    """The checked request id of a REPLY's metadata frame (see ``request_fields``)."""
    if len(meta) <= MAX_META_BYTES:
        # As in request_fields, with the check of "id" inlined too.
        try:
            fields = _unpackb(meta, raw=False, strict_map_key=True)
        except Exception:
            fields = None
        if type(fields) is dict:
            rid = fields.get("id")
            if type(rid) is str and 0 < len(rid) <= MAX_ID_CHARS:
                return rid
    return _str(_meta(meta), "id")  # raises the precise error


def _str(meta: dict[str, Any], key: str, *, limit: int = MAX_ID_CHARS, empty: bool = False) -> str:
    value = meta.get(key)
    if not isinstance(value, str) or len(value) > limit or (not value and not empty):
        raise MalformedMessage(f"field {key!r} must be a string of 1..{limit} characters")
    return value


def _int(meta: dict[str, Any], key: str, *, low: int, high: int) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise MalformedMessage(f"field {key!r} must be an integer in [{low}, {high}]")
    return value


def _request_fields(meta: dict[str, Any]) -> tuple[str, str, float, int]:
    budget = meta.get("b")
    if (
        not isinstance(budget, int | float)
        or isinstance(budget, bool)
        or not math.isfinite(budget)
        or budget < 0
    ):
        raise MalformedMessage("field 'b' (budget_s) must be a finite number >= 0")
    # Inlined _str/_int checks: this runs for every request the broker routes.
    rid = meta.get("id")
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_ID_CHARS:
        raise MalformedMessage(f"field 'id' must be a string of 1..{MAX_ID_CHARS} characters")
    service = meta.get("svc")
    if not isinstance(service, str) or not 0 < len(service) <= MAX_ID_CHARS:
        raise MalformedMessage(f"field 'svc' must be a string of 1..{MAX_ID_CHARS} characters")
    attempt = meta.get("a")
    if type(attempt) is not int or not 1 <= attempt <= 1_000_000:
        raise MalformedMessage("field 'a' must be an integer in [1, 1000000]")
    return rid, service, float(budget), attempt


def _build_request(meta: dict[str, Any], body: bytes) -> Message:
    rid, service, budget_s, attempt = _request_fields(meta)
    return Request(rid, service, budget_s, body, attempt)


def _build_partial(meta: dict[str, Any], body: bytes) -> Message:
    return Partial(_str(meta, "id"), _int(meta, "n", low=0, high=2**62), body)


def _build_reply(meta: dict[str, Any], body: bytes) -> Message:
    return Reply(_str(meta, "id"), body)


def _build_failure(meta: dict[str, Any], body: bytes) -> Message:
    retryable = meta.get("r")
    if not isinstance(retryable, bool):
        raise MalformedMessage("field 'r' (retryable) must be a boolean")
    return FailureReply(
        _str(meta, "id"),
        _str(meta, "k", limit=64),
        _str(meta, "m", limit=MAX_TEXT_CHARS, empty=True),
        retryable,
        body,
    )


def _build_heartbeat(meta: dict[str, Any], body: bytes) -> Message:
    if "c" not in meta:
        return Heartbeat(_str(meta, "p", empty=True))
    return Heartbeat(_str(meta, "p", empty=True), _int(meta, "c", low=0, high=MAX_CAPACITY))


def _build_cancel(meta: dict[str, Any], body: bytes) -> Message:
    return Cancel(_str(meta, "id"))


def _build_ready(meta: dict[str, Any], body: bytes) -> Message:
    services = meta.get("s")
    if (
        not isinstance(services, list)
        or not 1 <= len(services) <= 64
        or not all(isinstance(s, str) and 0 < len(s) <= 64 for s in services)
    ):
        raise MalformedMessage("field 's' (services) must list 1..64 service names")
    info = meta.get("i", {})
    if not isinstance(info, dict):
        raise MalformedMessage("field 'i' (info) must be a map")
    return Ready(tuple(services), _int(meta, "c", low=1, high=MAX_CAPACITY), info)


def _build_disconnect(meta: dict[str, Any], body: bytes) -> Message:
    return Disconnect(_str(meta, "r", limit=MAX_TEXT_CHARS, empty=True))


def _build_status(meta: dict[str, Any], body: bytes) -> Message:
    return Status(_str(meta, "id"))


_BUILDERS: Final[dict[Kind, Callable[[dict[str, Any], bytes], Message]]] = {
    Kind.REQUEST: _build_request,
    Kind.PARTIAL: _build_partial,
    Kind.REPLY: _build_reply,
    Kind.FAILURE: _build_failure,
    Kind.HEARTBEAT: _build_heartbeat,
    Kind.CANCEL: _build_cancel,
    Kind.READY: _build_ready,
    Kind.DISCONNECT: _build_disconnect,
    Kind.STATUS: _build_status,
}
