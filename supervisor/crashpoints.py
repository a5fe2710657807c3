"""Test-only crash points: the supervisor SIGKILLs itself at an exact place.

Off unless the supervisor process is started with ``CORRAL_CRASHPOINT=NAME[:N]``:
the N-th time (default 1) the engine reaches point ``NAME``, the process sends
itself SIGKILL, no cleanup, no flush beyond the log line before it. That makes
the crash matrix of ``tests/crash/`` exact and deterministic instead of racing
a kill from outside.

Points (each placed right AFTER the named state is committed to the store):

| name | where |
|---|---|
| ``model_call_before`` | ``model_step_started`` committed, the model request not yet sent |
| ``model_stream`` | a text delta of the model stream received (live only, nothing committed) |
| ``model_reply`` | the model step (items, usage, calls ``requested``) committed, none dispatched |
| ``tool_running`` | a tool call's first output received and its ``started`` state committed |
| ``tool_result`` | a call's ``tool_call_end`` and output committed, the next model call not sent |
| ``approval_wait`` | ``exec_approval_request`` committed (the turn waits for the user) |
| ``compaction`` | the compaction call answered; the new context held provisionally, not durable |
| ``final_answer`` | the final answer committed (phase ``stopping``), ``turn_complete`` not yet |
| ``publish`` | a step's events committed, not yet handed to subscribers (``reach_async``) |

Firing once: a restarted supervisor inherits its parent's environment, so
with the variable alone it would crash again at the same place until the
farm escalates. ``CORRAL_CRASHPOINT_ONCE=PATH`` makes the point fire at most
once per PATH: the hook creates PATH (``O_EXCL``, content: the wall-clock time
of the kill) and skips when it already exists. Tests set both.

Arming at run time (``corral chaos``): with ``CORRAL_CRASHPOINT_ARM=PATH``,
whoever writes a point name into PATH arms that point once: the first
process to reach it claims the file (``rename`` to ``PATH.fired``, atomic, so
one kill per arming even across restarts), appends the wall-clock time and
its pid to it, and SIGKILLs itself. The chaos schedule arms points at random
(``supervisor/chaos/schedule.py``): faults land inside the narrow windows.

``reach_async`` (used where the window is about what subscribers see) lets
the event loop run for ``SETTLE_S`` before the kill, so what was handed to
subscribers just before the point really leaves the process.

Invariants:
- With ``CORRAL_CRASHPOINT`` and ``CORRAL_CRASHPOINT_ARM`` unset, ``reach`` is
  a constant-time no-op (the variables are read once, at import).
- An unknown point name in the variable is refused at import (``ValueError``),
  so a typo cannot silently disable a crash test.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import Final

log = logging.getLogger(__name__)

ENV: Final = "CORRAL_CRASHPOINT"
ONCE_ENV: Final = "CORRAL_CRASHPOINT_ONCE"
POINTS: Final = frozenset({
    "model_call_before", "model_stream", "model_reply", "tool_running", "tool_result",
    "approval_wait", "compaction", "final_answer", "publish",
})
ARM_ENV: Final = "CORRAL_CRASHPOINT_ARM"
SETTLE_S: Final = 0.5  # 0.1 s was sometimes too short on a loaded 2-core machine


def parse(spec: str) -> tuple[str, int]:
    """``NAME[:N]`` → (name, n); raises ``ValueError`` saying what is wrong."""
    name, _, count = spec.strip().partition(":")
    if name not in POINTS:
        raise ValueError(f"{ENV}: unknown crash point {name!r}; known: {sorted(POINTS)}")
    try:
        n = int(count) if count else 1
    except ValueError:
        raise ValueError(f"{ENV}: count {count!r} is not an integer") from None
    if n < 1:
        raise ValueError(f"{ENV}: count must be >= 1, got {n}")
    return name, n


_raw = os.environ.get(ENV, "")
_TARGET: tuple[str, int] | None = parse(_raw) if _raw else None
_ONCE: str | None = os.environ.get(ONCE_ENV) or None
_ARM: str | None = os.environ.get(ARM_ENV) or None
ARMED: Final = _TARGET is not None or _ARM is not None  # False: every reach is a no-op
_reached = 0


def reach(name: str) -> None:
    """Mark that the engine reached point ``name``; SIGKILL ourselves if armed for it."""
    if _should_fire(name):
        _kill(name)


async def reach_async(name: str) -> None:
    """``reach``, but the loop runs ``SETTLE_S`` before the kill (queued sends go out)."""
    if _should_fire(name):
        await asyncio.sleep(SETTLE_S)
        _kill(name)


def _claim_arm(path: str, name: str) -> bool:
    """Whether the run-time arm file names ``name``; if so it is claimed (once)."""
    try:
        with open(path) as f:
            armed = f.read().strip()
    except (FileNotFoundError, OSError):
        return False
    if armed != name:
        return False
    try:
        os.rename(path, path + ".fired")  # atomic: one process, one kill per arming
    except OSError:
        return False
    with open(path + ".fired", "a") as f:
        f.write(f"\n{time.time():.6f} {os.getpid()}\n")
    return True


def _should_fire(name: str) -> bool:
    global _reached
    if not ARMED:
        return False
    if _ARM is not None and _claim_arm(_ARM, name):
        return True
    if _TARGET is None or _TARGET[0] != name:
        return False
    _reached += 1
    if _reached != _TARGET[1]:
        return False
    if _ONCE is not None:
        try:
            fd = os.open(_ONCE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return False
        try:
            os.write(fd, f"{time.time():.6f}\n".encode())
        finally:
            os.close(fd)
    return True


def _kill(name: str) -> None:
    log.critical("crash point %s reached (%d): SIGKILL pid %d", name, _reached, os.getpid())
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL)
