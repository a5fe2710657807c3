"""What each test costs in CPU, children included: the suite's time budget.

The suite must finish in 10 minutes on a 2-core machine, and wall durations
there mostly measure what else ran at the same time. CPU seconds do not: with
``CORRAL_TEST_CPU_REPORT=FILE`` each pytest process (each xdist worker) moves
itself into its own cgroup of the ``cpuacct`` controller (v1) or its own v2
group, so every process a test starts, daemons and sandboxed tools included,
is counted there, whatever session or parent it ends up under. Each test's
line in FILE (JSON lines, appended) is its node id, its wall seconds and the
group's CPU seconds during it.

``python -m tests.cpureport FILE`` sums a run: the heaviest tests, and the
total by directory.

Invariants:
- Off unless the variable is set; when the cgroup cannot be made (no root, no
  controller), the tests run as usual and the report says so once.
- The group is removed at the end of the session (processes left in it are
  moved back to the root group first).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_V1 = "/sys/fs/cgroup/cpuacct"
_V2 = "/sys/fs/cgroup"


class CpuGroup:
    """One cgroup holding this process and all it starts; reads its CPU time."""

    def __init__(self, name: str) -> None:
        if os.path.isfile(f"{_V1}/cpuacct.usage"):
            self.root, self.v2 = _V1, False
        elif os.path.isfile(f"{_V2}/cgroup.controllers"):
            self.root, self.v2 = _V2, True
        else:
            raise OSError("no cpuacct (v1) or unified (v2) cgroup hierarchy")
        self.path = f"{self.root}/corral-tests/{name}"
        os.makedirs(self.path, exist_ok=True)
        with open(f"{self.path}/cgroup.procs", "w") as f:
            f.write(str(os.getpid()))

    def cpu_s(self) -> float:
        if self.v2:
            with open(f"{self.path}/cpu.stat") as f:
                usec = dict(line.split() for line in f)["usage_usec"]
            return int(usec) / 1e6
        with open(f"{self.path}/cpuacct.usage") as f:
            return int(f.read()) / 1e9

    def close(self) -> None:
        with contextlib.suppress(OSError), open(f"{self.path}/cgroup.procs") as f:
            pids = f.read().split()
        for pid in pids:
            with contextlib.suppress(OSError), open(f"{self.root}/cgroup.procs", "w") as f:
                f.write(pid)
        with contextlib.suppress(OSError):
            os.rmdir(self.path)


class CpuReport:
    """The pytest plugin: one JSON line per test."""

    def __init__(self, out: Path) -> None:
        self.out = out
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.group: CpuGroup | None = None
        try:
            self.group = CpuGroup(f"{worker}-{os.getpid()}")
        except OSError as exc:
            print(f"cpureport: off ({exc})", file=sys.stderr)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Iterator[None]:
        if self.group is None:
            yield
            return
        cpu0, t0 = self.group.cpu_s(), time.monotonic()
        yield
        line = {"test": item.nodeid, "wall_s": round(time.monotonic() - t0, 3),
                "cpu_s": round(self.group.cpu_s() - cpu0, 3),
                "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}
        with open(self.out, "a") as f:
            f.write(json.dumps(line) + "\n")

    def pytest_sessionfinish(self) -> None:
        if self.group is not None:
            self.group.close()


def summarize(path: Path, top: int = 40) -> str:
    rows: list[dict[str, Any]] = [json.loads(line) for line in path.read_text().splitlines()
                                  if line.strip()]
    cpu = sum(r["cpu_s"] for r in rows)
    lines = [f"{len(rows)} tests, {cpu:.0f} CPU-s in all "
             f"({cpu / 2:.0f} s on 2 cores at best)", "", "heaviest tests (cpu_s wall_s):"]
    for r in sorted(rows, key=lambda r: -r["cpu_s"])[:top]:
        lines.append(f"  {r['cpu_s']:7.1f} {r['wall_s']:7.1f}  {r['test']}")
    by_dir: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for r in rows:
        d = by_dir["/".join(r["test"].split("::")[0].split("/")[:2])]
        d[0] += r["cpu_s"]
        d[1] += r["wall_s"]
        d[2] += 1
    lines += ["", "by directory (cpu_s wall_s tests):"]
    for name, (c, w, n) in sorted(by_dir.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"  {c:7.0f} {w:7.0f} {int(n):5d}  {name}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 40))
