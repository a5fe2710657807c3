"""A lifeline to the supervising parent: a child of the farm exits when its
parent is gone.

The farm's root starts every child with ``CORRAL_PARENT_PID`` set to its own
pid. If the root dies without stopping its children (SIGKILL, OOM), the
children are re-parented and would run on as orphans holding sockets, ports
and sandboxes. ``watch_parent`` starts a daemon thread that notices the
change of parent within ``interval_s`` and sends this process SIGTERM (a
graceful stop), then SIGKILL after ``grace_s`` if it is still alive.

Invariants:
- Without ``CORRAL_PARENT_PID`` (a process started by hand) nothing happens.
- A thread, not an asyncio task, so it works in the broker's blocking loop
  and even when an event loop is stuck.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Final

log = logging.getLogger(__name__)

ENV: Final = "CORRAL_PARENT_PID"


def watch_parent(*, interval_s: float = 0.5, grace_s: float = 10.0) -> bool:
    """Start the watch if this process has a supervising parent; True if started."""
    raw = os.environ.get(ENV)
    if not raw:
        return False
    try:
        expected = int(raw)
    except ValueError:
        log.warning("ignoring %s=%r: not a pid", ENV, raw)
        return False
    if os.getppid() != expected:
        # Already orphaned before we looked: stop at once.
        log.warning("parent %d is gone; stopping", expected)
        os.kill(os.getpid(), signal.SIGTERM)
        return True

    def watch() -> None:
        while os.getppid() == expected:
            time.sleep(interval_s)
        log.warning("parent %d is gone; stopping", expected)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="corral-lifeline", daemon=True).start()
    return True
