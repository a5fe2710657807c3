"""Run one sandboxed argv chain: stream its output, bound it, time it, and
kill its whole process tree when it must end early.

The process started here is the head of the chain (``setpriv`` → ``prlimit``
→ ``bwrap`` or the T1 launcher); every program in the chain ``exec``s in
place, so ``proc.pid`` is bwrap's monitor (T2) or the launcher (T1/T0), and
every process of the call is a descendant of it (the pid namespace at T2, the
launcher's subreaper at T1/T0).

Invariants:
- Output kept per stream is at most ``output_bytes``; once a stream reaches
  the cap the call is killed (a flood never runs on).
- PARTIAL chunks are coalesced: at most one per stream per ``coalesce_s``,
  each at most ``MAX_CHUNK_BYTES``; the total streamed equals what is kept.
- ``run`` never returns or raises while a process of the call is alive:
  ``kill_tree`` (the one kill path) finds the call's processes as the head's
  descendants *and* every process of the call's own uid (so a double-forked,
  re-parented orphan is found too), SIGTERMs them, waits ``grace_s``, then
  SIGKILLs until none is left, and reaps the head. Cancellation runs the
  same clean-up to completion, then re-raises.
- The event loop is never blocked: pipes are asyncio streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import psutil

from broker import plants  # chaos plant switches
from sandbox_worker.sandbox.reaper import MANAGED_HEADS, spawning

log = logging.getLogger(__name__)

StreamName = Literal["stdout", "stderr"]
OnChunk = Callable[[StreamName, bytes], Awaitable[None]]
MAX_CHUNK_BYTES: Final = 256 * 1024
READ_BYTES: Final = 64 * 1024
DRAIN_AFTER_EXIT_S: Final = 1.0
GRACE_POLL_S: Final = 0.1  # how often the grace period looks whether the call is gone
KILL_ROUND_S: Final = 0.2  # one SIGKILL round waits this long for its processes
KILL_DEADLINE_S: Final = 5.0  # SIGKILL rounds stop (and log) after this long


@dataclass
class RunSpec:
    argv: list[str]
    env: dict[str, str]
    wall_s: float
    output_bytes: int
    pass_fds: Sequence[int] = ()
    # The chain starts in "/" (each tier then enters the workspace itself): it
    # inherited the worker's directory, which the cgroup link's shell put in
    # PWD, so a T2 call read the worker's path in /proc/1/environ.
    cwd: str | None = "/"
    grace_s: float = 2.0
    coalesce_s: float = 0.05
    uid: int | None = None  # the call's own uid: its processes are found by it too
    stdin: bytes | None = None  # written to the command's stdin, then closed (None: /dev/null)


@dataclass
class RunOutcome:
    exit_code: int | None
    signal: int | None
    stdout: bytes
    stderr: bytes
    stdout_bytes: int
    stderr_bytes: int
    truncated: bool
    timed_out: bool
    flooded: bool
    duration_s: float
    leftover_killed: int = 0


@dataclass
class _Stream:
    name: StreamName
    kept: bytearray = field(default_factory=bytearray)
    pending: bytearray = field(default_factory=bytearray)
    truncated: bool = False


class _Output:
    """Per-stream bounded buffers and the coalescing PARTIAL flusher."""

    def __init__(self, cap: int, on_chunk: OnChunk | None, coalesce_s: float) -> None:
        self.cap = cap
        self.on_chunk = on_chunk
        self.coalesce_s = coalesce_s
        self.streams = {"stdout": _Stream("stdout"), "stderr": _Stream("stderr")}
        self.flood = asyncio.Event()
        self.data = asyncio.Event()

    def add(self, name: StreamName, data: bytes) -> None:
        st = self.streams[name]
        room = self.cap - len(st.kept)
        if len(data) > room:
            data = data[:room]
            st.truncated = True
            self.flood.set()
        st.kept += data
        if self.on_chunk is not None and data:
            st.pending += data
            self.data.set()

    async def flush(self) -> None:
        if self.on_chunk is None:
            return
        for st in self.streams.values():
            while st.pending:
                chunk = bytes(st.pending[:MAX_CHUNK_BYTES])
                del st.pending[:MAX_CHUNK_BYTES]
                await self.on_chunk(st.name, chunk)

    async def flusher(self) -> None:
        while True:
            await self.data.wait()
            # Coalesce: whatever arrives in the window goes out as one chunk.
            await asyncio.sleep(self.coalesce_s)
            self.data.clear()
            await self.flush()

    async def reader(self, name: StreamName, stream: asyncio.StreamReader | None) -> None:
        if stream is None:
            return
        st = self.streams[name]
        while True:
            data = await stream.read(READ_BYTES)
            if not data:
                return
            if st.truncated:
                continue  # keep draining so the writer is not blocked, keep nothing
            self.add(name, data)


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return list(psutil.Process(pid).children(recursive=True))
    except psutil.Error:
        return []


def of_uid(uid: int) -> list[psutil.Process]:
    """Every live process whose real or effective uid is ``uid`` (host-wide)."""
    found = []
    for p in psutil.process_iter(["uids", "status"]):
        try:
            ids = p.info["uids"]
            if (uid in (ids.real, ids.effective)
                    and p.info["status"] != psutil.STATUS_ZOMBIE):
                found.append(p)
        except (psutil.Error, TypeError, AttributeError):
            continue
    return found


def call_processes(head_pid: int | None, uid: int | None) -> list[psutil.Process]:
    """The live processes of one call: the head's descendants and, when the
    call has a uid of its own, every process of that uid, wherever it was
    re-parented (a double fork, a dead launcher, pid 1). The uid is the
    call's alone while it runs (``uidpool.py``), so nothing else is touched.
    ``head_pid`` is None once the head is reaped (its pid may be reused)."""
    procs = {p.pid: p for p in descendants(head_pid)} if head_pid is not None else {}
    if uid is not None and uid > 0:
        for p in of_uid(uid):
            if p.pid != head_pid:
                procs.setdefault(p.pid, p)
    return list(procs.values())


def _signal_all(procs: Sequence[psutil.Process], sig: int) -> None:
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(sig)


async def kill_tree(proc: asyncio.subprocess.Process, grace_s: float,
                    uid: int | None = None) -> int:
    """End every process of the call: SIGTERM, ``grace_s``, SIGKILL, reap.

    The one place a call's process tree is killed (cancel, timeout, flood,
    a failing output sink). The head (bwrap's monitor, or the launcher) is
    spared the SIGTERM so the command gets its grace period (the launcher
    forwards SIGTERM itself). The grace ends early once the head is gone and
    nothing of the call is left. SIGKILL then goes to the head and to every
    process of ``call_processes``, repeated until none is alive (each round
    catches what was forked or re-parented meanwhile), bounded by
    ``KILL_DEADLINE_S``. Returns how many were still alive at the SIGKILL step.
    """
    if plants.on("no_tree_kill"):  # chaos plant: the direct child only, no tree
        return await _kill_head_only(proc)
    loop = asyncio.get_running_loop()
    snapshot = call_processes(_head(proc), uid)
    _signal_all(snapshot, signal.SIGTERM)
    if proc.returncode is None and not snapshot:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
    grace_end = loop.time() + grace_s
    while loop.time() < grace_end:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(GRACE_POLL_S, max(0.0, grace_end - loop.time()))):
                await proc.wait()
        if proc.returncode is not None and not _living(call_processes(_head(proc), uid)):
            break
    survivors = _living([*snapshot, *call_processes(_head(proc), uid)])
    counted = len(survivors)
    deadline = loop.time() + KILL_DEADLINE_S
    while True:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        _signal_all(survivors, signal.SIGKILL)
        if survivors:
            await asyncio.to_thread(psutil.wait_procs, survivors, KILL_ROUND_S)
        survivors = _living([*survivors, *call_processes(_head(proc), uid)])
        if not survivors:
            break
        if loop.time() > deadline:
            log.error("%d processes of a call survived SIGKILL for %.0f s: %s",
                      len(survivors), KILL_DEADLINE_S, [p.pid for p in survivors])
            break
    await proc.wait()
    return counted


def _head(proc: asyncio.subprocess.Process) -> int | None:
    return proc.pid if proc.returncode is None else None


def _living(procs: Sequence[psutil.Process]) -> list[psutil.Process]:
    seen: dict[int, psutil.Process] = {}
    for p in procs:
        if p.pid not in seen and _alive(p):
            seen[p.pid] = p
    return list(seen.values())


async def _kill_head_only(proc: asyncio.subprocess.Process) -> int:
    """The ``no_tree_kill`` plant's bad path (``broker/plants.py``)."""
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    await proc.wait()
    return 0


def _alive(p: psutil.Process) -> bool:
    try:
        return bool(p.is_running() and p.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


async def run_to_completion(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run bounded clean-up to the end even if cancelled meanwhile; then re-raise."""
    task = asyncio.ensure_future(coro)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                break
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return task.result()


async def _feed(pipe: asyncio.StreamWriter | None, data: bytes | None) -> None:
    """Write ``data`` to the command's stdin and close it. A command that
    reads none of it (or exits first) is not an error: its stdin is gone."""
    if pipe is None:
        return
    try:
        if data:
            pipe.write(data)
            await pipe.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        with contextlib.suppress(OSError):
            pipe.close()


async def run(spec: RunSpec, on_chunk: OnChunk | None = None) -> RunOutcome:
    """Run ``spec.argv`` to its end, a timeout, or an output flood."""
    out = _Output(spec.output_bytes, on_chunk, spec.coalesce_s)
    start = time.monotonic()
    with spawning():  # no orphan sweep until the head is registered (reaper.py)
        proc = await asyncio.create_subprocess_exec(
            *spec.argv,
            stdin=asyncio.subprocess.DEVNULL if spec.stdin is None else asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=spec.env,
            cwd=spec.cwd,
            pass_fds=tuple(spec.pass_fds),
            start_new_session=True,
            close_fds=True,
        )
        MANAGED_HEADS.add(proc.pid)
    timed_out = False
    killed = 0
    try:
        async with asyncio.TaskGroup() as tg:
            readers = [tg.create_task(out.reader("stdout", proc.stdout)),
                       tg.create_task(out.reader("stderr", proc.stderr))]
            feeder = tg.create_task(_feed(proc.stdin, spec.stdin))
            flusher = tg.create_task(out.flusher())
            flood_wait = tg.create_task(out.flood.wait())
            exit_wait = tg.create_task(proc.wait())
            done, _ = await asyncio.wait({flood_wait, exit_wait}, timeout=spec.wall_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                timed_out = True
            if proc.returncode is None:
                killed = await run_to_completion(kill_tree(proc, spec.grace_s, spec.uid))
            flood_wait.cancel()
            await exit_wait
            # Output written just before exit is still in the pipes; drain it,
            # bounded (a leftover holding the pipe open must not hang the call).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(DRAIN_AFTER_EXIT_S):
                    await asyncio.gather(*readers)
            for r in readers:
                r.cancel()
            feeder.cancel()
            flusher.cancel()
        await out.flush()
    except ExceptionGroup as group:
        # One failing task (e.g. ``on_chunk`` could not send a PARTIAL) is the
        # cause; surface it as itself so the caller's handlers see its type.
        raise group.exceptions[0] from None
    finally:
        if proc.returncode is None:
            await run_to_completion(kill_tree(proc, spec.grace_s, spec.uid))
        MANAGED_HEADS.discard(proc.pid)
    rc = proc.returncode
    so, se = out.streams["stdout"], out.streams["stderr"]
    return RunOutcome(
        exit_code=rc if rc is not None and rc >= 0 else None,
        signal=-rc if rc is not None and rc < 0 else None,
        stdout=bytes(so.kept),
        stderr=bytes(se.kept),
        stdout_bytes=len(so.kept),
        stderr_bytes=len(se.kept),
        truncated=so.truncated or se.truncated,
        timed_out=timed_out,
        flooded=out.flood.is_set(),
        duration_s=time.monotonic() - start,
        leftover_killed=killed,
    )
