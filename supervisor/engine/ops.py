"""Validation of the ops a client submits to a session.

An op is a JSON-like dict with a ``type``; ``parse_op`` turns it into a frozen
dataclass or raises ``BadOp`` whose message names the field and the problem.
Nothing here touches a session: a malformed op is rejected at ``submit`` and
never reaches (nor kills) the session loop.

Ops::

    user_input     {text: str, attachments?: [{id, name, size, media_type}]}
    interrupt      {turn_id: str}
    exec_approval  {id: str, decision: approved | approved_for_session | denied | abort}
    set_model      {route: str}
    compact        {}
    shutdown       {}

Invariants:
- Every string and list is bounded (``MAX_TEXT_CHARS``, ``MAX_ATTACHMENTS``...);
  unknown keys are rejected, so a typo never silently does nothing.
- ``parse_op`` raises only ``BadOp``, whatever the input (fuzzed with Hypothesis).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from supervisor.engine.errors import BadOp

MAX_TEXT_CHARS: Final = 1_000_000
MAX_ATTACHMENTS: Final = 64
MAX_ID_CHARS: Final = 256
MAX_NAME_CHARS: Final = 1024
APPROVAL_DECISIONS: Final = ("approved", "approved_for_session", "denied", "abort")


@dataclass(frozen=True, slots=True)
class Attachment:
    id: str
    name: str
    size: int
    media_type: str

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "size": self.size,
                "media_type": self.media_type}


@dataclass(frozen=True, slots=True)
class UserInput:
    text: str
    attachments: tuple[Attachment, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"type": "user_input", "text": self.text,
                "attachments": [a.to_json() for a in self.attachments]}


@dataclass(frozen=True, slots=True)
class Interrupt:
    turn_id: str


@dataclass(frozen=True, slots=True)
class ExecApproval:
    id: str
    decision: str


@dataclass(frozen=True, slots=True)
class SetModel:
    route: str


@dataclass(frozen=True, slots=True)
class Compact:
    pass


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


Op = UserInput | Interrupt | ExecApproval | SetModel | Compact | Shutdown

_KEYS: Final[dict[str, frozenset[str]]] = {
    "user_input": frozenset({"type", "text", "attachments"}),
    "interrupt": frozenset({"type", "turn_id"}),
    "exec_approval": frozenset({"type", "id", "decision"}),
    "set_model": frozenset({"type", "route"}),
    "compact": frozenset({"type"}),
    "shutdown": frozenset({"type"}),
}


def _str(op: Mapping[str, Any], key: str, *, limit: int, empty: bool = False) -> str:
    value = op.get(key)
    if not isinstance(value, str):
        raise BadOp(f"field {key!r} must be a string, got {type(value).__name__}")
    if len(value) > limit:
        raise BadOp(f"field {key!r} is longer than {limit} characters")
    if not value and not empty:
        raise BadOp(f"field {key!r} must not be empty")
    return value


def _attachment(raw: Any, index: int) -> Attachment:
    if not isinstance(raw, Mapping):
        raise BadOp(f"attachments[{index}] must be an object")
    extra = set(raw) - {"id", "name", "size", "media_type"}
    if extra:
        raise BadOp(f"attachments[{index}] has unknown keys {sorted(map(str, extra))}")
    size = raw.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise BadOp(f"attachments[{index}].size must be an integer >= 0")
    try:
        return Attachment(
            id=_str(raw, "id", limit=MAX_ID_CHARS),
            name=_str(raw, "name", limit=MAX_NAME_CHARS),
            size=size,
            media_type=_str(raw, "media_type", limit=MAX_NAME_CHARS),
        )
    except BadOp as exc:
        raise BadOp(f"attachments[{index}]: {exc}") from None


def parse_op(op: Any) -> Op:
    """Validate a submitted op; raise ``BadOp`` saying what is wrong."""
    if not isinstance(op, Mapping):
        raise BadOp(f"an op must be an object, got {type(op).__name__}")
    kind = op.get("type")
    if not isinstance(kind, str) or kind not in _KEYS:
        raise BadOp(f"field 'type' must be one of {sorted(_KEYS)}, got {kind!r}"[:300])
    extra = [k for k in op if k not in _KEYS[kind]]
    if extra:
        raise BadOp(f"{kind} op has unknown keys {sorted(map(str, extra))}"[:300])
    if kind == "user_input":
        text = _str(op, "text", limit=MAX_TEXT_CHARS, empty=True)
        raw = op.get("attachments", [])
        if not isinstance(raw, list):
            raise BadOp("field 'attachments' must be a list")
        if len(raw) > MAX_ATTACHMENTS:
            raise BadOp(f"at most {MAX_ATTACHMENTS} attachments")
        attachments = tuple(_attachment(a, i) for i, a in enumerate(raw))
        if not text and not attachments:
            raise BadOp("user_input needs a non-empty 'text' or attachments")
        return UserInput(text, attachments)
    if kind == "interrupt":
        return Interrupt(_str(op, "turn_id", limit=MAX_ID_CHARS))
    if kind == "exec_approval":
        decision = op.get("decision")
        if decision not in APPROVAL_DECISIONS:
            raise BadOp(f"field 'decision' must be one of {list(APPROVAL_DECISIONS)}")
        return ExecApproval(_str(op, "id", limit=MAX_ID_CHARS), str(decision))
    if kind == "set_model":
        return SetModel(_str(op, "route", limit=MAX_ID_CHARS))
    if kind == "compact":
        return Compact()
    return Shutdown()

