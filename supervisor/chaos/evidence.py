"""Evidence the chaos harness gathers from the process table while it runs.

The workload's long tool calls name themselves in their command lines
(``chaos-long-<session>-<k>``, ``chaos-orphan-<session>-<k>``, see
``workload.py``). Two readers use that:

- ``ProcWatch`` samples the whole process table every ``every_s`` and keeps,
  per token, when it was first and last seen alive and a pid: after the run,
  a call's processes seen alive well after its ``tool_call_end`` are orphans
  (the tree kill missed them), whatever killed the call (a cancel, a worker's
  death, a timeout).
- ``calls_in_cgroup`` reads which calls a worker was running at the instant it
  is killed, from its cgroup (``worker_cgroup_dirs``): those calls must end
  ``unknown`` with ``worker_lost`` promptly.

Invariants: facts only, as the kernel shows them (``/proc``, ``cgroup.procs``);
a process that vanishes while being read is skipped, never guessed; every
sample is bounded by the size of the process table.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

import psutil

from sandbox_worker.api import worker_cgroup_dirs
from supervisor.chaos.workload import TOKEN_RE

log = logging.getLogger(__name__)

Token = tuple[str, int, int]  # (long | orphan, session index, marker k)


def token_of(cmdline: list[str], run: str) -> Token | None:
    """The token of this run in ``cmdline``, if any (other runs' are ignored)."""
    m = TOKEN_RE.search(" ".join(cmdline))
    if m is None or m.group(2) != run:
        return None
    return (m.group(1), int(m.group(3)), int(m.group(4)))


@dataclass
class Sighting:
    pid: int
    first: float  # time.monotonic() of the first sample that saw it
    last: float  # ... and of the last one


@dataclass
class ProcWatch:
    """Sightings of the workload's tokens in the process table."""

    run: str
    seen: dict[Token, Sighting] = field(default_factory=dict)
    samples: int = 0

    def sample(self) -> None:
        now = time.monotonic()
        for p in psutil.process_iter(["cmdline", "status"]):
            with contextlib.suppress(psutil.Error):
                if p.info["status"] == psutil.STATUS_ZOMBIE or not p.info["cmdline"]:
                    continue
                tok = token_of(p.info["cmdline"], self.run)
                if tok is None:
                    continue
                s = self.seen.get(tok)
                if s is None:
                    self.seen[tok] = Sighting(p.pid, now, now)
                else:
                    s.last, s.pid = now, p.pid
        self.samples += 1

    def alive_now(self) -> dict[Token, int]:
        """Tokens alive at this instant (after the farm is down: orphans)."""
        out: dict[Token, int] = {}
        for p in psutil.process_iter(["cmdline", "status"]):
            with contextlib.suppress(psutil.Error):
                if p.info["status"] != psutil.STATUS_ZOMBIE and p.info["cmdline"]:
                    tok = token_of(p.info["cmdline"], self.run)
                    if tok is not None:
                        out[tok] = p.pid
        return out


def calls_in_cgroup(worker_pid: int, run: str) -> set[tuple[int, int]]:
    """(session index, k) of the long calls running in the worker's cgroup now."""
    pids: set[int] = set()
    for d in worker_cgroup_dirs(worker_pid):
        with contextlib.suppress(OSError, ValueError), open(f"{d}/cgroup.procs") as f:
            pids.update(int(x) for x in f.read().split())
    out: set[tuple[int, int]] = set()
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            tok = token_of(psutil.Process(pid).cmdline(), run)
            if tok is not None and tok[0] == "long":
                out.add((tok[1], tok[2]))
    return out


def kill_leftovers(pids: list[int]) -> None:
    """After reporting them: SIGKILL orphans so one run's leftovers never leak
    into the host (the report has already named them)."""
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()
