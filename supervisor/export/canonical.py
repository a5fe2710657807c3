"""Canonical JSON and content digests for portable checkpoints.

Canonical form: keys sorted, no whitespace (separators ``,`` and ``:``), UTF-8, non-ASCII
kept as is, a lone surrogate (which UTF-8 cannot carry) written as its lower-case
``\\uXXXX`` escape, NaN/Infinity refused. The digest is ``"sha256:" + hex`` of those
bytes. The encoder is the store's (``sandbox_worker.api.json_text``).

Invariant: equal JSON values give equal bytes, so a digest identifies content.
"""

from __future__ import annotations

import hashlib
from typing import Any

from sandbox_worker.api import json_text

DIGEST_PREFIX = "sha256:"


def canonical_bytes(value: Any) -> bytes:
    return json_text(value, sort_keys=True)[0].encode("utf-8")


def digest_bytes(data: bytes) -> str:
    return DIGEST_PREFIX + hashlib.sha256(data).hexdigest()


def digest(value: Any) -> str:
    return digest_bytes(canonical_bytes(value))


def is_digest(value: object) -> bool:
    if not isinstance(value, str) or not value.startswith(DIGEST_PREFIX):
        return False
    hexpart = value[len(DIGEST_PREFIX):]
    return len(hexpart) == 64 and all(c in "0123456789abcdef" for c in hexpart)
