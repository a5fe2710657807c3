"""One long-lived cgroup per worker bounding the memory and process count of
all its tool calls together.

Here cgroups are v1/hybrid: the ``memory`` and ``pids`` controllers are v1
hierarchies only root can write. The worker (root) creates
``<controller>/corral/worker-<pid>`` once at start-up; each call joins it
through the first link of its argv chain (a one-line ``sh`` that writes its
own pid to ``cgroup.procs`` and then ``exec``s ``setpriv``), so every
process of the call is inside before any sandboxed code runs. A per-call
cgroup would cost 2-14 ms a call (SANDBOX.md); this costs one ``sh`` exec.

On a pure v2 machine the same is done under the unified hierarchy when the
``memory`` and ``pids`` controllers are enabled for the root's children.

Invariants:
- Whether the cgroup applied is recorded (``applied``/``reason``) and shown
  in the isolation record's ``degraded`` list when it did not.
- ``close`` removes the worker's groups (after its calls are gone); groups of
  dead workers are emptied (SIGKILL) and removed at start-up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from dataclasses import dataclass, field

log = logging.getLogger(__name__)
CGROUP_ROOT = "/sys/fs/cgroup"


@dataclass
class WorkerCgroup:
    memory_bytes: int
    pids: int
    dirs: list[str] = field(default_factory=list)
    procs_files: list[str] = field(default_factory=list)
    applied: bool = False
    reason: str = ""
    version: str = ""

    def setup(self) -> None:
        """Create the groups; on any failure record why and stay unapplied."""
        name = f"worker-{os.getpid()}"
        try:
            if os.path.isdir(f"{CGROUP_ROOT}/memory") and os.path.isdir(f"{CGROUP_ROOT}/pids"):
                self.version = "v1"
                plan = [(f"{CGROUP_ROOT}/memory/corral", "memory.limit_in_bytes",
                         self.memory_bytes),
                        (f"{CGROUP_ROOT}/pids/corral", "pids.max", self.pids)]
                for base, knob, value in plan:
                    os.makedirs(base, exist_ok=True)
                    _remove_stale(base)
                    path = f"{base}/{name}"
                    os.makedirs(path, exist_ok=True)
                    self.dirs.append(path)
                    _write(f"{path}/{knob}", str(value))
                    self.procs_files.append(f"{path}/cgroup.procs")
                with contextlib.suppress(OSError):
                    _write(f"{self.dirs[0]}/memory.swappiness", "0")
            elif os.path.exists(f"{CGROUP_ROOT}/cgroup.controllers"):
                self.version = "v2"
                with open(f"{CGROUP_ROOT}/cgroup.subtree_control") as f:
                    enabled = f.read().split()
                if "memory" not in enabled or "pids" not in enabled:
                    raise OSError("memory/pids controllers are not enabled for children")
                base = f"{CGROUP_ROOT}/corral"
                os.makedirs(base, exist_ok=True)
                _write(f"{base}/cgroup.subtree_control", "+memory +pids")
                _remove_stale(base)
                path = f"{base}/{name}"
                os.makedirs(path, exist_ok=True)
                self.dirs.append(path)
                _write(f"{path}/memory.max", str(self.memory_bytes))
                _write(f"{path}/pids.max", str(self.pids))
                self.procs_files.append(f"{path}/cgroup.procs")
            else:
                raise OSError("no memory/pids cgroup hierarchy is mounted")
            self.applied = True
        except OSError as exc:
            self.reason = f"worker cgroup not applied: {exc.strerror or exc}"
            log.warning("%s", self.reason)
            self.close()
            self.procs_files = []

    def join_prefix(self) -> list[str]:
        """argv prefix that moves the chain into the groups, then execs the rest."""
        if not self.applied:
            return []
        script = ('n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; '
                  'shift; n=$((n-1)); done; exec "$@"')
        return ["/bin/sh", "-c", script, "corral-cgroup", str(len(self.procs_files)),
                *self.procs_files]

    def close(self) -> None:
        for path in self.dirs:
            with contextlib.suppress(OSError):
                os.rmdir(path)
        self.dirs = []


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _remove_stale(base: str) -> None:
    """Remove the groups of workers that no longer exist, SIGKILLing whatever
    of their calls is still inside (a backstop: calls normally die with their
    worker, see launch.py and bwrap's --die-with-parent)."""
    with contextlib.suppress(OSError):
        for entry in os.listdir(base):
            if not entry.startswith("worker-"):
                continue
            try:
                pid = int(entry.removeprefix("worker-"))
                os.kill(pid, 0)
                continue
            except (ValueError, ProcessLookupError):
                pass
            except PermissionError:
                continue
            with contextlib.suppress(OSError, ValueError):
                with open(f"{base}/{entry}/cgroup.procs") as f:
                    left = [int(p) for p in f.read().split()]
                for pid in left:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                if left:
                    log.warning("killed %d leftover processes of dead %s", len(left), entry)
            with contextlib.suppress(OSError):
                os.rmdir(f"{base}/{entry}")
