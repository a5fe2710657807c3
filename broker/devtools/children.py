"""What the benchmarks of every package share: their child processes and their table.

A benchmark starts the farm's processes (``python -m broker``, ``python -m
sandbox_worker`` ...) as children in sessions of their own, waits for each one's
JSON ready line under a deadline, and stops them by pid at the end; it prints its
figures as a two-column table. The broker package is the one both the supervisor's
and the worker's dev tools may import (docs/architecture.md), so this lives here.

Invariants:
- ``read_line`` (``ready_line``) never waits past its deadline and never reads past the
  line's newline (one byte at a time: what a child writes after it stays in the pipe).
- ``stop`` ends every child it is given: SIGTERM (last started first), a 10 s grace
  each, then SIGKILL, and always a wait, so none is left a zombie or running.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import subprocess
import time
from collections.abc import Iterable, Mapping
from typing import Any, Final

STOP_GRACE_S: Final = 10.0


def spawn(argv: list[str]) -> subprocess.Popen[bytes]:
    """A child in its own session, its stdout a pipe (for the ready line), its
    stderr discarded."""
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def ready_line(proc: subprocess.Popen[bytes], timeout_s: float,
               what: str | None = None) -> dict[str, Any]:
    """The child's first stdout line, a JSON object, read under ``timeout_s``
    (``read_line``)."""
    ready: dict[str, Any] = json.loads(read_line(proc, timeout_s, what))
    return ready


def read_line(proc: subprocess.Popen[bytes], timeout_s: float,
              what: str | None = None) -> bytes:
    """The child's next stdout line (with its newline), read under ``timeout_s``.
    Raises ``RuntimeError`` naming ``what`` (default: the pid) when the child
    exits first or the deadline passes."""
    name = what or f"pid {proc.pid}"
    if proc.stdout is None:
        raise RuntimeError(f"{name}: no stdout pipe")
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout_s
    buf = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise RuntimeError(f"{name} not ready within {timeout_s:g}s")
            chunk = os.read(fd, 1)
            if not chunk:
                raise RuntimeError(f"{name} exited before it was ready")
            buf += chunk
    return buf


def stop(procs: Iterable[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each child (the last started first), wait for it up to
    ``STOP_GRACE_S``, SIGKILL what is left, reap all, close their pipes."""
    started = list(procs)
    for proc in reversed(started):
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
    for proc in started:
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def print_table(*sections: Mapping[str, Any], header: bool = False) -> None:
    """Each figure on a line: its name left in 40 columns, its value right in 12."""
    if header:
        print(f"{'measure':<40} {'value':>12}")
    for rows in sections:
        for key, value in rows.items():
            print(f"{key:<40} {value!s:>12}")
