"""Shared test helpers: real child processes cleaned up by pid, and waiting on
conditions with deadlines (never sleeping and hoping).

Every process a test starts goes through ``Procs.spawn``; the ``procs`` fixture
kills whatever is left, by process group and by pid, and reaps it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psutil

from broker.devtools.children import read_line

T = TypeVar("T")
REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


class Procs:
    """Tracks the processes a test started, and kills them all at the end."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[subprocess.Popen[bytes]] = []

    def spawn(
        self,
        argv: Sequence[str],
        *,
        name: str = "proc",
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        stdout: int | None = None,
    ) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{name}-{len(self.started)}.log", "wb")  # noqa: SIM115
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        proc = subprocess.Popen(
            list(argv),
            stdout=stdout if stdout is not None else log,
            stderr=log,
            env=full_env,
            cwd=cwd or REPO,
            start_new_session=True,
        )
        log.close()
        self.started.append(proc)
        return proc

    def python(self, module: str, *args: str, name: str | None = None,
               env: dict[str, str] | None = None,
               stdout: int | None = None) -> subprocess.Popen[bytes]:
        return self.spawn([PYTHON, "-m", module, *args], name=name or module, env=env,
                          stdout=stdout)

    def log(self, proc: subprocess.Popen[bytes]) -> str:
        for i, p in enumerate(self.started):
            if p is proc:
                for f in self.log_dir.glob(f"*-{i}.log"):
                    return f.read_text(errors="replace")
        return ""

    def kill_all(self) -> None:
        for proc in self.started:
            kill_tree(proc.pid)
        for proc in self.started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for proc in self.started:  # the pipes of readiness lines the test read from
            if proc.stdout is not None:
                proc.stdout.close()
        leaked = [p.pid for p in self.started if p.poll() is None]
        if leaked:
            raise RuntimeError(f"test processes survived cleanup: {leaked}")


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Kill a process, its group and all its descendants (then SIGCONT stopped ones)."""
    try:
        root = psutil.Process(pid)
        children = root.children(recursive=True)
    except psutil.Error:
        children = []
    for target in [pid, *(c.pid for c in children)]:
        try:
            os.kill(target, sig)
            if sig == signal.SIGKILL:
                os.kill(target, signal.SIGCONT)
        except (ProcessLookupError, PermissionError):
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def wait_until(
    predicate: Callable[[], T], *, timeout_s: float = 10.0, interval_s: float = 0.01,
    what: str = "condition",
) -> T:
    """Poll ``predicate`` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


async def eventually(
    predicate: Callable[[], Awaitable[T]], *, timeout_s: float = 10.0,
    interval_s: float = 0.01, what: str = "condition",
) -> T:
    """Async version of ``wait_until`` (Temporal's ``assert_eventually``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(interval_s)


@contextlib.contextmanager
def searchable_dir(prefix: str, parent: str) -> Iterator[Path]:
    """A fresh directory in ``parent``, mode 0755 so that a non-root sandbox uid can
    enter it (pytest's tmp_path sits under a 0700 directory of root); removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def read_line_with_deadline(proc: subprocess.Popen[bytes], timeout_s: float) -> str:
    """Read one line of a child's stdout (a readiness handshake) under a deadline."""
    try:
        return read_line(proc, timeout_s).decode().strip()
    except RuntimeError as exc:
        raise AssertionError(f"{exc} (exit status {proc.poll()})") from exc


def read_ready(proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> dict[str, Any]:
    """A child's first stdout line, which must be its JSON ``{"event": "ready", ...}`` line."""
    ready = json.loads(read_line_with_deadline(proc, timeout_s))
    if ready.get("event") != "ready":
        raise AssertionError(f"unexpected readiness line {ready}")
    return dict(ready)


@dataclass
class BrokerProc:
    """A broker process and the readiness line it printed (its bound endpoints)."""

    proc: subprocess.Popen[bytes]
    ready: dict[str, Any]

    @property
    def frontend(self) -> str:
        return str(self.ready["frontend"])

    @property
    def backend(self) -> str:
        return str(self.ready["backend"])


def spawn_broker(procs: Procs, *args: str, prefix: Sequence[str] = ()) -> BrokerProc:
    """``python -m broker *args`` (run through ``prefix``, e.g. ``ip netns exec NS``),
    returned once it printed its readiness line."""
    proc = procs.spawn([*prefix, PYTHON, "-m", "broker", *args], name="broker",
                       stdout=subprocess.PIPE)
    return BrokerProc(proc, read_ready(proc))
