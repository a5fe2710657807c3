"""Encoding of store payloads: canonical compact JSON, size bounds, secret redaction.

Items, payloads, configs and state rows are stored as compact UTF-8 JSON text (not
compressed, not msgpack): a secret scan of the raw database bytes
(``scan_db_bytes``) must be able to see anything that reached the disk, and JSON
keeps the file readable with the ``sqlite3`` shell.

Invariants:
- Every encoded value is bounded (``Limits``); an oversize value raises
  ``RecordTooLarge`` before anything is written.
- Any mapping key that names a credential (``SECRET_KEYS``, compared case-insensitively
  with ``-`` read as ``_``) has its value replaced by ``REDACTED`` before encoding, at
  any depth, in items, event payloads, session configs and state. The key itself stays,
  so the shape of the record is unchanged. The store redacts rather than refuses: a
  refusal would turn a defensive check into a failed turn, and the value never reaches
  the disk either way. Each redaction is logged (key path only, never the value).
- Values must be JSON-compatible (no bytes, no NaN); otherwise ``InvalidRequest``.
- The text is always valid UTF-8: a lone surrogate in a string (which UTF-8
  cannot carry) is written as its ``\\uXXXX`` JSON escape and reads back as the
  same string (``sandbox_worker.api.json_text``, the one encoder the worker's
  output bound is measured with too). Plain text columns (an execution's
  reason, a session's route) get U+FFFD for it, and for NUL, which PostgreSQL
  TEXT cannot hold, in both stores alike (``text_column``); a key (a session
  id, an event type) holding one is refused (``InvalidRequest``).
- The default bounds come from ``sandbox_worker.api`` (``STORE_ITEM_BYTES``,
  ``STORE_PAYLOAD_BYTES``), where the worker's output bound is derived from.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from sandbox_worker.api import (
    STORE_ITEM_BYTES,
    STORE_PAYLOAD_BYTES,
    SURROGATES,
    json_text,
    replace_surrogates,
)
from supervisor.store.errors import InvalidRequest, RecordTooLarge

log = logging.getLogger(__name__)

REDACTED = "[redacted]"
SECRET_KEYS = frozenset(
    {
        "api_key",
        "apikey",
        "x_api_key",
        "authorization",
        "proxy_authorization",
        "access_token",
        "refresh_token",
        "client_secret",
        "secret_key",
        "password",
        "bearer_token",
    }
)
# Fast path: one regex pass over the encoded JSON finds any key that may be a secret
# (a quoted name followed by a colon); only then is the value walked and redacted.
_KEY_RE = re.compile(
    r'"(?:' + "|".join(sorted(k.replace("_", "[_-]") for k in SECRET_KEYS)) + r')":',
    re.IGNORECASE,
)


@dataclass(frozen=True, slots=True)
class Limits:
    """Upper bounds of what one write may carry, in bytes of encoded JSON."""

    max_item_bytes: int = STORE_ITEM_BYTES  # one transcript item
    max_batch_bytes: int = 8 << 20  # one transcript batch
    max_payload_bytes: int = STORE_PAYLOAD_BYTES  # one event payload
    max_state_bytes: int = 1 << 20  # the checkpoint state row (no context in it)
    max_config_bytes: int = 256 << 10  # a session config
    max_rewrite_bytes: int = 64 << 20  # a whole rewritten context
    max_events_per_step: int = 10_000


def _is_secret_key(key: str) -> bool:
    return key.lower().replace("-", "_") in SECRET_KEYS


def _redact(value: Any, path: str, hits: list[str]) -> Any:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if isinstance(k, str) and _is_secret_key(k) and v not in (None, "", REDACTED):
                out[k] = REDACTED
                hits.append(f"{path}.{k}")
            else:
                out[k] = _redact(v, f"{path}.{k}", hits)
        return out
    if isinstance(value, list):
        return [_redact(v, f"{path}[{i}]", hits) for i, v in enumerate(value)]
    return value


def _dumps(value: Any, what: str) -> tuple[str, int]:
    try:
        return json_text(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidRequest(f"{what} is not JSON-compatible: {exc}") from exc


def encode(value: Any, *, what: str, limit: int) -> str:
    """Compact JSON of ``value`` with secrets redacted; ``RecordTooLarge`` above ``limit``."""
    text, size = _dumps(value, what)
    if _KEY_RE.search(text):
        hits: list[str] = []
        value = _redact(value, what, hits)
        if hits:
            log.warning("store redacted credential-named fields: %s", ", ".join(hits[:10]))
            text, size = _dumps(value, what)
    if size > limit:
        raise RecordTooLarge(f"{what} is {size} bytes, above its bound of {limit} bytes")
    return text


def encode_items(items: list[dict[str, Any]], *, what: str, limits: Limits,
                 total_limit: int) -> str:
    """Encode a list of items, bounding each item and the whole list."""
    if not isinstance(items, list):
        raise InvalidRequest(f"{what} must be a list of items")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InvalidRequest(f"{what}[{i}] must be an object, not {type(item).__name__}")
    text = encode(items, what=what, limit=total_limit)
    # The per-item bound can only be exceeded when the whole list is above it.
    if len(text) > limits.max_item_bytes // 4 and len(text.encode()) > limits.max_item_bytes:
        for i, item in enumerate(items):
            encode(item, what=f"{what}[{i}]", limit=limits.max_item_bytes)
    return text


def check_key(value: str | None, what: str) -> None:
    """A key column (a session id, a type) must be UTF-8 text: ``InvalidRequest``."""
    if value is not None and SURROGATES.search(value):
        raise InvalidRequest(f"{what} is not valid text (it holds a lone surrogate)")


def text_column(value: object) -> str | None:
    """A plain (non-key) TEXT column's value, the same in both stores: None for a
    non-string; a lone surrogate (UTF-8 cannot carry it) and NUL (PostgreSQL TEXT
    cannot hold it) become U+FFFD."""
    if not isinstance(value, str):
        return None
    return replace_surrogates(value).replace("\x00", "\ufffd")


def decode(text: str | bytes) -> Any:
    return json.loads(text)
