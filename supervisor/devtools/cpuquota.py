"""A CPU quota for a few processes, as the kernel enforces it: a cgroup of the ``cpu``
controller (v1 ``cpu.cfs_period_us`` / ``cpu.cfs_quota_us``, or v2 ``cpu.max``).

Used by ``supervisors_bench`` to run each supervisor under the same fraction of a core
in both phases (the supervisor-bound measurement). ``quota(name, cores)`` makes a group
under the controller's root, yields it, and on every exit (also on an exception) moves
whatever is still in it back to the root and removes it, by path. The group's
``stat()`` is the kernel's ``cpu.stat``: how many enforcement periods the group ran in,
in how many it was throttled, and for how long.

Needs root and a mounted ``cpu`` controller; ``QuotaUnavailable`` says which is missing.
A group left by a process that died before its cleanup (SIGKILL) is removed by the next
``quota()`` (its name carries the dead process's pid).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

PERIOD_US = 100_000
PREFIX = "corral-quota-"
REMOVE_TIMEOUT_S = 5.0


class QuotaUnavailable(RuntimeError):
    """No CPU quota can be made here (the message says why)."""


@dataclass(frozen=True)
class Controller:
    root: Path
    v2: bool


def controller() -> Controller:
    """Where the ``cpu`` controller is mounted (v1 preferred: it is what a v1 or hybrid
    host enforces); raises ``QuotaUnavailable``."""
    if os.geteuid() != 0:
        raise QuotaUnavailable(f"not root (euid {os.geteuid()}): cgroups need root")
    v2: Path | None = None
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        where, kind, options = Path(fields[1]), fields[2], fields[3].split(",")
        if kind == "cgroup" and "cpu" in options:
            return Controller(where, v2=False)
        if kind == "cgroup2" and "cpu" in _words(where / "cgroup.controllers"):
            v2 = where
    if v2 is not None:
        return Controller(v2, v2=True)
    raise QuotaUnavailable("no cgroup cpu controller is mounted (/proc/self/mounts)")


def _words(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except OSError:
        return []


class Group:
    """One cgroup with a CPU quota of ``cores`` (e.g. 0.25 of one core)."""

    def __init__(self, ctl: Controller, path: Path, cores: float) -> None:
        self.ctl, self.path, self.cores = ctl, path, cores

    def add(self, pid: int) -> None:
        """Move a process (all its threads) into the group."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        return [int(p) for p in _words(self.path / "cgroup.procs")]

    def stat(self) -> dict[str, float]:
        """The kernel's ``cpu.stat``: ``nr_periods``, ``nr_throttled``, ``throttled_s``."""
        raw = {k: int(v) for k, v in (line.split() for line in
                                      (self.path / "cpu.stat").read_text().splitlines())}
        throttled = (raw.get("throttled_usec", 0) / 1e6 if self.ctl.v2
                     else raw.get("throttled_time", 0) / 1e9)
        return {"nr_periods": raw.get("nr_periods", 0),
                "nr_throttled": raw.get("nr_throttled", 0), "throttled_s": throttled}

    def quota_read(self) -> float:
        """The quota the kernel holds, in cores (inf when unlimited)."""
        if self.ctl.v2:
            quota, period = (self.path / "cpu.max").read_text().split()
            return float("inf") if quota == "max" else int(quota) / int(period)
        q = int((self.path / "cpu.cfs_quota_us").read_text())
        return float("inf") if q < 0 else q / int((self.path / "cpu.cfs_period_us").read_text())


def _make(ctl: Controller, name: str, cores: float) -> Group:
    if ctl.v2 and "cpu" not in _words(ctl.root / "cgroup.subtree_control"):
        (ctl.root / "cgroup.subtree_control").write_text("+cpu")
    path = ctl.root / f"{PREFIX}{os.getpid()}-{name}"
    path.mkdir()
    group = Group(ctl, path, cores)
    quota = max(1000, round(cores * PERIOD_US))
    if ctl.v2:
        (path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
    else:
        (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (path / "cpu.cfs_quota_us").write_text(str(quota))
    return group


def remove(ctl: Controller, path: Path) -> None:
    """Move the group's processes back to the root, then remove the group (retried
    until ``REMOVE_TIMEOUT_S``: a process may be moved in or exit meanwhile)."""
    deadline = time.monotonic() + REMOVE_TIMEOUT_S
    while path.exists():
        for pid in _words(path / "cgroup.procs"):
            with contextlib.suppress(ProcessLookupError, FileNotFoundError):
                (ctl.root / "cgroup.procs").write_text(pid)
        try:
            path.rmdir()
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _sweep(ctl: Controller) -> None:
    """Remove the groups of processes that died before their cleanup."""
    for path in ctl.root.glob(f"{PREFIX}*"):
        pid = path.name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            logger.warning("removing a CPU quota group left by pid %s: %s", pid, path)
            remove(ctl, path)


@contextlib.contextmanager
def quota(name: str, cores: float) -> Iterator[Group]:
    """A group named ``name`` limited to ``cores``; removed on exit."""
    if not 0.0 < cores <= (os.cpu_count() or 1):
        raise ValueError(f"a CPU quota of {cores} cores")
    ctl = controller()
    _sweep(ctl)
    try:
        group = _make(ctl, name, cores)
    except OSError as e:
        with contextlib.suppress(OSError):
            remove(ctl, ctl.root / f"{PREFIX}{os.getpid()}-{name}")
        raise QuotaUnavailable(f"cannot make a cgroup under {ctl.root}: {e}") from e
    try:
        yield group
    finally:
        remove(ctl, group.path)
