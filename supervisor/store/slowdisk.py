"""Chaos only: a slow-disk fault for the store's write transactions.

Off unless the environment enables it (``corral chaos`` does, for the
supervisor process it starts):

- ``CORRAL_CHAOS_STORE_DELAY_S``: seconds to stall each write transaction
  just before its COMMIT, holding SQLite's write lock the way a slow fsync
  would;
- ``CORRAL_CHAOS_STORE_DELAY_FLAG`` (optional): a file path; when set, the
  stall applies only while that file exists, so the harness can switch the
  fault on and off at scheduled times without restarting the supervisor.

Invariants:
- With the variable unset (or 0) ``stall()`` returns at once and does nothing.
- The stall is bounded: the delay is at most ``MAX_DELAY_S``.
- It runs on the writer thread (inside ``apply_group``), never on the loop.
"""

from __future__ import annotations

import os
import time
from typing import Final

MAX_DELAY_S: Final = 5.0
DELAY_ENV: Final = "CORRAL_CHAOS_STORE_DELAY_S"
FLAG_ENV: Final = "CORRAL_CHAOS_STORE_DELAY_FLAG"


def _delay_from_env() -> float:
    raw = os.environ.get(DELAY_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError as exc:
        raise ValueError(f"{DELAY_ENV} must be a number of seconds, not {raw!r}") from exc
    if not 0.0 <= value <= MAX_DELAY_S:
        raise ValueError(f"{DELAY_ENV} must be between 0 and {MAX_DELAY_S}, not {value}")
    return value


DELAY_S: Final = _delay_from_env()
FLAG: Final = os.environ.get(FLAG_ENV) or None
stalls = 0  # how many commits were stalled (for tests and logs)


def stall() -> None:
    """Sleep ``DELAY_S`` if the slow-disk fault is on; called before COMMIT."""
    global stalls
    if DELAY_S <= 0.0 or (FLAG is not None and not os.path.exists(FLAG)):
        return
    stalls += 1
    time.sleep(DELAY_S)
