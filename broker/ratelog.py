"""Rate-limited warnings: a fault that repeats (a database down, a peer dropping
frames) logs one line per key per period, with how many it stands for, instead
of one line per attempt.

Invariants:
- The first occurrence of a key is logged at once; later ones within ``every_s``
  are only counted, and the next line logged says how many it stands for.
- Memory is bounded by the number of distinct keys, which callers keep small
  (a fixed reason, never a session id).
"""

from __future__ import annotations

import logging
import time
from typing import Any


class RateLimitedLog:
    """``warning(key, msg, *args)``: at most one line per ``key`` per ``every_s``."""

    def __init__(self, logger: logging.Logger, every_s: float) -> None:
        self._log = logger
        self._every_s = every_s
        self._last: dict[str, float] = {}
        self._since: dict[str, int] = {}

    def warning(self, key: str, msg: str, *args: Any) -> bool:
        """Log (True) or count (False) one occurrence of ``key``."""
        now = time.monotonic()
        self._since[key] = self._since.get(key, 0) + 1
        last = self._last.get(key)
        if last is not None and now - last < self._every_s:
            return False
        count = self._since.pop(key)
        self._last[key] = now
        suffix = f" ({count} like this in the last {now - last:.0f} s)" \
            if last is not None and count > 1 else ""
        self._log.warning(msg + "%s", *args, suffix)
        return True
