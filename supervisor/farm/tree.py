"""The farm's root: supervises child processes the Erlang/OTP way.

Each child has a ``ChildSpec``: its argv, a restart policy, a readiness
timeout and a shutdown timeout. Children start in stages, in order: the
children of one stage start together, and a stage starts only once every
child before it printed its one JSON line ``{"event": "ready", ...}`` on
stdout (readiness is a handshake, never a sleep). A child's stage is its
spec's ``stage``; by default each child is a stage of its own (strict order).
A child that exits is restarted according to its policy; more than ``max_restarts`` restarts within
``within_s`` seconds escalates: the whole tree stops and ``run`` raises
``Escalation`` naming the child, its exit status and its log file.
Children stop in reverse order (consecutive children of one ``stop_group``
together): SIGTERM to the child's process group, the shutdown timeout,
SIGKILL, then always a wait until reaped.

Invariants:
- The parent learns of a child's death at once (it awaits the child's exit),
  long before any heartbeat could tell.
- Every child is its own process group (``start_new_session``), so stopping
  it stops everything it started; psutil sweeps any escaped descendant.
- Every wait has a deadline; ``stop`` always returns with no child left.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import psutil

log = logging.getLogger(__name__)

Restart = Literal["permanent", "transient", "temporary"]
MAX_READY_LINE_BYTES = 64 * 1024


class FarmError(Exception):
    """Base of the farm's errors."""


class ChildFailedToStart(FarmError):
    """A child exited or timed out before its ready line; the message carries the
    last error line it logged (its own words), and the log's path."""


_ERROR_TAIL_BYTES = 64 * 1024
_ERROR_MARKS = ("corral:", "error:", "Error:", "Error ", "failed")


def last_error_line(log_path: Path, offset: int = 0, *, prefix: str = "") -> str:
    """The line of ``log_path`` (written after ``offset``) that best says why a
    process failed: the last line with an error mark, else the last line; ``""``
    when there is none. Read from a bounded tail; control characters removed."""
    try:
        with open(log_path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(offset, size - _ERROR_TAIL_BYTES))
            data = f.read(_ERROR_TAIL_BYTES)
    except OSError:
        return ""
    lines = [ln.strip() for ln in data.decode("utf-8", "replace").splitlines() if ln.strip()]
    if not lines:
        return ""
    marked = [ln for ln in lines if any(m in ln for m in _ERROR_MARKS)]
    line = (marked or lines)[-1]
    line = "".join(c if c.isprintable() else "?" for c in line)[:500]
    return prefix + line


class Escalation(FarmError):
    """A child restarted too often; the tree was stopped."""


@dataclass(frozen=True)
class ChildSpec:
    name: str
    argv: list[str]
    restart: Restart = "permanent"  # permanent: always; transient: on abnormal exit
    ready_timeout_s: float = 30.0
    shutdown_timeout_s: float = 5.0
    env: dict[str, str] | None = None
    # Called before each start with the ready lines of every child started so
    # far (its own previous one included, on a restart); returns the argv to use,
    # e.g. to pass an URL learned from an earlier child or to pin a port.
    dynamic_argv: Callable[[dict[str, dict[str, Any]]], list[str]] | None = None
    # Consecutive children with the same stage (not None) start together: none of
    # them may need another's ready line. None: a stage of its own.
    stage: int | None = None
    # Consecutive children (in stop order) with the same stop_group (not None)
    # stop together, e.g. the sandbox workers; None: stopped on its own.
    stop_group: str | None = None

    def argv_for(self, ready: dict[str, dict[str, Any]]) -> list[str]:
        return self.dynamic_argv(ready) if self.dynamic_argv else self.argv


@dataclass
class ChildState:
    spec: ChildSpec
    proc: asyncio.subprocess.Process | None = None
    ready: dict[str, Any] = field(default_factory=dict)
    restarts: int = 0
    started_at: float = 0.0
    last_exit: int | None = None
    state: str = "stopped"  # starting | running | restarting | stopped | failed

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


class SupervisionTree:
    def __init__(
        self,
        specs: list[ChildSpec],
        *,
        log_dir: Path,
        max_restarts: int = 10,
        within_s: float = 60.0,
        on_change: Callable[[], None] | None = None,
        max_log_bytes: int = 32 * 1024 * 1024,
    ) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"child names must be unique: {names}")
        self.children = {s.name: ChildState(s) for s in specs}
        self.max_log_bytes = max_log_bytes
        self.log_dir = log_dir
        self.max_restarts = max_restarts
        self.within_s = within_s
        self._restart_times: deque[float] = deque()
        self._on_change = on_change or (lambda: None)
        self._stopping = False
        self.restart_log: deque[dict[str, Any]] = deque(maxlen=100)

    # -- starting ---------------------------------------------------------

    async def _spawn(self, child: ChildState, argv: list[str]) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{child.spec.name}.log"
        # A local append-only log; opening it cannot block on anything remote.
        err = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        log_offset = os.fstat(err).st_size
        try:
            child.proc = await asyncio.create_subprocess_exec(
                *argv,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
                stdin=asyncio.subprocess.DEVNULL,
                # CORRAL_PARENT_PID: the child's lifeline (broker.lifeline) makes it
                # stop if this process dies without stopping it.
                env={**os.environ, "PYTHONUNBUFFERED": "1", "CORRAL_PARENT_PID": str(os.getpid()),
                     **(child.spec.env or {})},
                start_new_session=True,
            )
        finally:
            os.close(err)
        child.state = "starting"
        child.started_at = time.monotonic()
        assert child.proc.stdout is not None
        try:
            async with asyncio.timeout(child.spec.ready_timeout_s):
                line = await child.proc.stdout.readline()
        except TimeoutError:
            await self._kill(child)
            raise ChildFailedToStart(
                f"{child.spec.name} did not report ready within {child.spec.ready_timeout_s}s"
                f"{last_error_line(log_path, log_offset, prefix=': ')}; see {log_path}") from None
        try:
            ready = json.loads(line[:MAX_READY_LINE_BYTES]) if line else None
        except json.JSONDecodeError:
            ready = None
        if not isinstance(ready, dict) or ready.get("event") != "ready":
            await self._kill(child)
            code = child.proc.returncode if child.proc else None
            raise ChildFailedToStart(
                f"{child.spec.name} failed to start"
                f"{last_error_line(log_path, log_offset, prefix=': ')} (exit {code}; "
                f"log {log_path})")
        child.ready = ready
        child.state = "running"
        self._on_change()

    def stages(self) -> list[list[ChildState]]:
        """The children in start order, grouped into the stages that start together."""
        stages: list[list[ChildState]] = []
        for child in self.children.values():
            stage = child.spec.stage
            if stages and stage is not None and stages[-1][0].spec.stage == stage:
                stages[-1].append(child)
            else:
                stages.append([child])
        return stages

    async def start(self) -> None:
        """Start every stage in order, each after every child before it is ready;
        the children of a stage start together. On any failure every child
        started (or starting) is stopped and the first failure is raised."""
        try:
            for stage in self.stages():
                ready = self.ready_lines()
                if len(stage) == 1:
                    await self._spawn(stage[0], stage[0].spec.argv_for(ready))
                    continue
                # Every spawn of the stage runs to its end (ready, or failed within
                # its own ready timeout): none is cancelled half-way, where a
                # process could be left started and not yet known.
                results = await asyncio.gather(
                    *(self._spawn(child, child.spec.argv_for(ready)) for child in stage),
                    return_exceptions=True)
                for result in results:
                    if isinstance(result, BaseException):
                        raise result
        except BaseException:
            for child in reversed(list(self.children.values())):
                await self._stop_child(child)
            raise

    # -- running ----------------------------------------------------------

    async def run(self, on_ready: Callable[[], None] | None = None) -> None:
        """Start, then supervise until cancelled (stops the tree) or escalation."""
        await self.start()
        if on_ready is not None:
            on_ready()
        await self.supervise()

    async def supervise(self) -> None:
        """Restart children as they exit, until cancelled (then stop the tree) or
        escalation; the tree must have been started."""
        try:
            async with asyncio.TaskGroup() as tg:
                for child in self.children.values():
                    tg.create_task(self._watch(child))
                tg.create_task(self._bound_logs())
        finally:
            await self.stop()

    async def _bound_logs(self, interval_s: float = 5.0) -> None:
        """Keep every child's log under ``max_log_bytes``: a log over the bound is
        copied to NAME.log.1 (replacing the previous one) and truncated in place.
        Children write with O_APPEND, so they carry on at the new end; lines
        written between the copy and the truncation are lost (a small window)."""
        while True:
            await asyncio.sleep(interval_s)
            for name in self.children:
                path = self.log_dir / f"{name}.log"
                await asyncio.to_thread(_rotate_if_large, path, self.max_log_bytes)

    async def _watch(self, child: ChildState) -> None:
        while True:
            proc = child.proc
            if proc is None:
                return
            async with asyncio.TaskGroup() as tg:
                # A child's stdout is only for the ready line; keep draining it
                # so a chatty child can never block on a full pipe.
                drain = tg.create_task(_drain(proc.stdout))
                await _exited(proc.pid)
                drain.cancel()
            if self._stopping:
                return
            # Sweep whatever the dead child left in its process group. Only then
            # can proc.wait() return: asyncio also waits for the stdout pipe,
            # which a surviving grandchild would hold open.
            _kill_group(proc.pid)
            code: int | None = None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(10):
                    code = await proc.wait()
            child.last_exit = code
            policy = child.spec.restart
            if policy == "temporary" or (policy == "transient" and code == 0):
                child.state = "stopped"
                self._on_change()
                return
            await self._restart(child, _describe(code))

    async def _restart(self, child: ChildState, why: str) -> None:
        while True:
            now = time.monotonic()
            self._restart_times.append(now)
            while self._restart_times and now - self._restart_times[0] > self.within_s:
                self._restart_times.popleft()
            if len(self._restart_times) > self.max_restarts:
                child.state = "failed"
                raise Escalation(
                    f"{child.spec.name} failed ({why}) and the farm has restarted children "
                    f"more than {self.max_restarts} times in {self.within_s:.0f}s; stopping "
                    f"everything. See {self.log_dir / (child.spec.name + '.log')}")
            child.restarts += 1
            child.state = "restarting"
            self.restart_log.append({"child": child.spec.name, "why": why,
                                     "at": time.time(), "restarts": child.restarts})
            log.warning("%s failed (%s); restarting (%d so far)", child.spec.name, why,
                        child.restarts)
            self._on_change()  # farm.json says the restart now, not once it is ready
            argv = child.spec.argv_for(self.ready_lines())
            try:
                await self._spawn(child, argv)
                return
            except ChildFailedToStart as exc:
                why = str(exc)

    # -- stopping ---------------------------------------------------------

    async def stop(self) -> None:
        """Stop every child in reverse start order (a stop group together);
        always returns with none left."""
        self._stopping = True
        group: list[ChildState] = []
        for child in reversed(list(self.children.values())):
            name = child.spec.stop_group
            if group and (name is None or group[0].spec.stop_group != name):
                await self._stop_together(group)
                group = []
            group.append(child)
        await self._stop_together(group)

    async def _stop_together(self, children: list[ChildState]) -> None:
        # _stop_child never raises but for cancellation; each has its deadline
        await asyncio.gather(*(self._stop_child(child) for child in children))

    async def _stop_child(self, child: ChildState) -> None:
        proc = child.proc
        if proc is None:
            return
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                async with asyncio.timeout(child.spec.shutdown_timeout_s):
                    await proc.wait()
            except TimeoutError:
                log.warning("%s did not stop within %.1fs; killing", child.spec.name,
                            child.spec.shutdown_timeout_s)
        await self._kill(child)
        child.state = "stopped"
        self._on_change()

    async def _kill(self, child: ChildState) -> None:
        proc = child.proc
        if proc is None:
            return
        _kill_group(proc.pid)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10):
                await proc.wait()

    def ready_lines(self) -> dict[str, dict[str, Any]]:
        return {name: c.ready for name, c in self.children.items() if c.ready}

    def status(self) -> list[dict[str, Any]]:
        return [
            {"name": c.spec.name, "pid": c.pid, "state": c.state, "restarts": c.restarts,
             "uptime_s": round(time.monotonic() - c.started_at, 1) if c.pid else None,
             "last_exit": c.last_exit, "ready": c.ready}
            for c in self.children.values()
        ]


def _rotate_if_large(path: Path, max_bytes: int) -> None:
    try:
        if path.stat().st_size <= max_bytes:
            return
        shutil.copyfile(path, path.with_name(path.name + ".1"))
        os.truncate(path, 0)
    except FileNotFoundError:
        return


async def _exited(pid: int) -> None:
    """Return as soon as process ``pid`` has exited (a pidfd: no polling)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await done
    finally:
        loop.remove_reader(fd)
        os.close(fd)


async def _drain(stream: asyncio.StreamReader | None) -> None:
    if stream is None:
        return
    while await stream.read(65536):
        pass


def _describe(code: int | None) -> str:
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _kill_group(pgid: int) -> None:
    """SIGKILL a process group and any descendant that left it (psutil backstop)."""
    victims: list[psutil.Process] = []
    with contextlib.suppress(psutil.Error):
        victims = psutil.Process(pgid).children(recursive=True)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    for p in victims:
        with contextlib.suppress(psutil.Error):
            p.kill()
