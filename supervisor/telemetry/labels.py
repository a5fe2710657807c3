"""Bounded label values for metrics.

A label's values come from outside (a tool name the model chose, a failure
kind a provider sent, a worker's host name): each label keeps at most
``limit`` distinct values and reports any further one as ``"other"``, so a
misbehaving model or peer cannot grow the series without bound.
"""

from __future__ import annotations

import re
import threading

OTHER = "other"
# HOME/chaos-faults.json: ``corral chaos`` writes its injected faults by kind
# there ({"faults": {kind: count}}), the metrics collector reads it (standard
# library only here, so the harness can import it without prometheus_client).
CHAOS_FAULTS_FILE = "chaos-faults.json"
_CLEAN = re.compile(r"[^A-Za-z0-9_.:\-]")


class Bounded:
    """Map raw values to at most ``limit`` distinct label values (thread-safe)."""

    def __init__(self, limit: int = 32, *, max_chars: int = 64) -> None:
        self.limit = limit
        self.max_chars = max_chars
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: object) -> str:
        text = _CLEAN.sub("_", str(value if value is not None else "none"))[: self.max_chars]
        text = text or "none"
        with self._lock:
            if text in self._seen:
                return text
            if len(self._seen) >= self.limit:
                return OTHER
            self._seen.add(text)
            return text
