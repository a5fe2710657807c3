"""Benchmark of sandboxed tool calls: ``python -m sandbox_worker.devtools.tools_bench
[--quick] [--json]`` (``scripts/bench tools``).

Measured in one run, on this machine, so only ratios are compared:

- ``subprocess``: a bare ``subprocess.run(["true"])``;
- ``bwrap_chain``: the exact argv chain the worker builds for a T2 call
  (cgroup join, setpriv, prlimit, bwrap with the same flags and seccomp fd)
  running ``true``, started with ``asyncio.create_subprocess_exec`` and
  interleaved with the e2e calls so machine noise hits both alike;
- ``e2e``: a ``shell`` call running ``true`` from ``BrokerClient.start`` to
  the final reply, through a real broker and a real worker process;
- ``throughput``: tool calls per second with 4 workers and 32 calls in flight;
- ``uid_lease``: taking and giving back one per-call uid as the worker does
  (flock, lock-file marker; no /proc scan for a uid given back clean), which
  every e2e call pays and the bare chain does not;
- ``workspace_grant_release``: one call's workspace cycle as the worker runs
  it (the use file held, the tree granted, then released: every Corral ACL
  entry revoked), on the benchmark's empty workspace and on a 1,000-entry
  tree (100 directories of 9 files); every e2e call pays the first.

- images (``supervisor/devtools/image_bench.py``, run as a child process: the
  image store is the supervisor's): ``e2e_image_vs_host`` (a sandboxed
  ``true`` over an image's root against the host's, target <= 1.2) and
  ``image_import_mb_per_s`` against ``tar -x`` of the same layer
  (``image_import_vs_tar``).

Ratios: ``e2e_vs_bwrap`` (target <= 1.5), ``e2e_vs_subprocess``,
``uid_lease_vs_bwrap`` and ``workspace_grant_release_vs_bwrap``; and the
outside tools' (``outside_bench.py``): ``mcp_call_vs_direct`` (target <= 2.0),
``command_tool_vs_shell`` (target <= 1.2), with ``mcp_cold_start_s``.
Results are printed as a table, and with ``--json`` as one JSON object that is
also written to ``bench-results/tools.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from broker.client import BrokerClient
from broker.devtools.children import print_table, ready_line, spawn, stop
from broker.protocol import pack, unpack
from sandbox_worker.devtools.outside_bench import bench_command_tool, bench_mcp
from sandbox_worker.sandbox import wslease
from sandbox_worker.sandbox.cgroup import WorkerCgroup
from sandbox_worker.sandbox.limits import DEFAULT_LIMITS
from sandbox_worker.sandbox.ownership import release
from sandbox_worker.sandbox.profile import Profile
from sandbox_worker.sandbox.reaper import PR_SET_CHILD_SUBREAPER
from sandbox_worker.sandbox.seccomp import SeccompFilters
from sandbox_worker.sandbox.uidpool import DEFAULT_UID_COUNT, DEFAULT_UID_START, UidPool
from sandbox_worker.sandbox.user import SandboxUser, ensure_user
from sandbox_worker.sandbox.workspace import grant_tree
from sandbox_worker.sandbox.wsgroups import DEFAULT_GID_START

READY_TIMEOUT_S = 30.0


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def _p90_ms(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))] * 1000


def bench_subprocess(n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(["true"], check=True)
        out.append(time.perf_counter() - t)
    return out


def bench_uid_lease(user: SandboxUser, n: int) -> list[float]:
    """One per-call uid lease: flock + /proc scan, then release (+ scan)."""
    pool = UidPool(DEFAULT_UID_START, DEFAULT_UID_COUNT, user.gid)
    pool.setup(reserved_uids=(user.uid,))
    out = []
    try:
        for _ in range(n):
            t = time.perf_counter()
            lease = pool.try_acquire()
            if lease is None:
                raise RuntimeError("no free sandbox uid")
            pool.release(lease, tree_gone=True)  # as the worker does after a call
            out.append(time.perf_counter() - t)
    finally:
        pool.close()
    return out


def bench_workspace_cycle(n: int, entries: int) -> list[float]:
    """One call's grant and release of a workspace of ``entries`` entries
    (directories of 9 files each), as ``WorkspacePins`` does it."""
    root = tempfile.mkdtemp(prefix="corral-bench-grant-", dir="/tmp")
    groups = tempfile.mkdtemp(prefix="corral-bench-groups-", dir="/tmp")
    try:
        for d in range(entries // 10):
            os.mkdir(f"{root}/d{d}")
            for f in range(9):
                Path(f"{root}/d{d}/f{f}").write_text("x")
        fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
        st = os.fstat(fd)
        ident = (st.st_dev, st.st_ino)
        gid = DEFAULT_GID_START
        out = []
        try:
            for _ in range(n):
                t = time.perf_counter()
                lease = wslease.acquire(groups, ident, root)
                try:
                    grant_tree(fd, gid)
                    if not wslease.try_exclusive(lease):
                        raise RuntimeError("the workspace's use file is held")
                    if release(fd, lambda _uid: False, lambda g: g == gid).complete:
                        wslease.mark_clean(lease)
                finally:
                    os.close(lease)
                out.append(time.perf_counter() - t)
        finally:
            os.close(fd)
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(groups, ignore_errors=True)


class BareChain:
    """The worker's exact T2 chain for ``true``, run without broker or worker. The
    orphaned namespace inits are reaped here as the worker does (subreaper)."""

    def __init__(self, workspace: str, user: SandboxUser) -> None:
        self.workspace = workspace
        self.filters = SeccompFilters.compile()
        self.cgroup = WorkerCgroup(8 << 30, 2048)
        self.cgroup.setup()
        self.profile = Profile("T2", user, self.filters, self.cgroup)
        # The bare chain runs as one leased uid throughout (no per-call lease).
        self.pool = UidPool(DEFAULT_UID_START, DEFAULT_UID_COUNT, user.gid)
        self.pool.setup(reserved_uids=(user.uid,))
        lease = self.pool.try_acquire()
        if lease is None:
            raise RuntimeError("no free sandbox uid for the bare chain")
        self.lease = lease
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

    async def once(self) -> float:
        t = time.perf_counter()
        chain = self.profile.build(["true"], self.workspace, DEFAULT_LIMITS, network=False,
                                   uid=self.lease.uid)
        try:
            proc = await asyncio.create_subprocess_exec(
                *chain.argv, env=chain.env, pass_fds=chain.pass_fds, start_new_session=True,
                stdin=subprocess.DEVNULL)
        finally:
            for fd in chain.pass_fds:
                os.close(fd)
        if await proc.wait() != 0:
            raise RuntimeError("the bare bwrap chain failed")
        dt = time.perf_counter() - t
        _reap_orphans()
        return dt

    def close(self) -> None:
        self._libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        _reap_orphans()
        self.cgroup.close()
        self.filters.close()
        self.pool.close()


def _reap_orphans() -> None:
    """Reap orphaned namespace inits (zombie children asyncio does not wait for).
    Only called between runs, when no chain head is pending."""
    from sandbox_worker.sandbox.reaper import MANAGED_HEADS, _children, _status

    for pid in _children():
        st = _status(pid)
        if pid not in MANAGED_HEADS and st is not None and st[0]:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


class Stack:
    """A broker and N tool workers as child processes (killed by pid on exit)."""

    def __init__(self, workers: int, capacity: int) -> None:
        self.workers = workers
        self.capacity = capacity
        self.dir = tempfile.mkdtemp(prefix="cbench-", dir="/tmp")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.frontend = ""

    def __enter__(self) -> Stack:
        py = sys.executable
        broker = spawn([py, "-m", "broker", "--frontend", f"ipc://{self.dir}/f",
                        "--backend", f"ipc://{self.dir}/b"])
        self.procs.append(broker)
        ready = ready_line(broker, READY_TIMEOUT_S)
        self.frontend = ready["frontend"]
        for _ in range(self.workers):
            self.procs.append(spawn(
                [py, "-m", "sandbox_worker", "--broker", ready["backend"], "--services", "tool",
                 "--capacity", str(self.capacity), "--log-level", "WARNING"]))
        for proc in self.procs[1:]:
            ready_line(proc, READY_TIMEOUT_S)
        return self

    def __exit__(self, *exc: object) -> None:
        stop(self.procs)
        shutil.rmtree(self.dir, ignore_errors=True)


def _body(workspace: str, i: int) -> bytes:
    return pack({"call_id": f"bench-{i}", "tool": "shell", "arguments": {"command": ["true"]},
                 "session_id": "bench", "workspace": workspace})


async def bench_e2e_and_chain(frontend: str, workspace: str, n: int, bare: BareChain,
                              ) -> tuple[list[float], list[float]]:
    """Interleaved, so machine noise hits both series alike."""
    e2e: list[float] = []
    chain: list[float] = []
    async with BrokerClient(frontend) as client:
        for i in range(n + 3):
            t = time.perf_counter()
            result = unpack(await client.start("tool", _body(workspace, i), budget_s=30)
                            .result())
            dt = time.perf_counter() - t
            if result["outcome"] != "ok":
                raise RuntimeError(f"bench call failed: {result['output']}")
            bare_dt = await bare.once()
            if i >= 3:  # the first calls grant the workspace and warm up
                e2e.append(dt)
                chain.append(bare_dt)
    return e2e, chain


async def bench_throughput(frontend: str, workspace: str, total: int, in_flight: int,
                           ) -> float:
    async with BrokerClient(frontend) as client:
        sem = asyncio.Semaphore(in_flight)

        async def one(i: int) -> None:
            async with sem:
                result = unpack(await client.start("tool", _body(workspace, i), budget_s=60)
                                .result())
                if result["outcome"] != "ok":
                    raise RuntimeError(f"bench call failed: {result['output']}")

        await asyncio.gather(*(one(i) for i in range(in_flight)))  # warm-up
        t = time.perf_counter()
        async with asyncio.TaskGroup() as tg:
            for i in range(total):
                tg.create_task(one(i))
        return total / (time.perf_counter() - t)


IMAGE_RATIOS = ("e2e_image_vs_host", "image_import_vs_tar")


def bench_images(quick: bool) -> dict[str, Any]:
    """The image figures (``supervisor.devtools.image_bench``), from a child process."""
    argv = [sys.executable, "-m", "supervisor.devtools.image_bench", "--json"]
    done = subprocess.run([*argv, "--quick"] if quick else argv, capture_output=True,
                          text=True, timeout=900, check=False)
    if done.returncode != 0:
        return {"image_bench_failed": (done.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def machine() -> dict[str, Any]:
    return {"host": platform.node(), "cpus": os.cpu_count(), "kernel": platform.release(),
            "python": platform.python_version(), "bwrap": shutil.which("bwrap") is not None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sandbox_worker.devtools.tools_bench",
                                     description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--quick", action="store_true", help="a reduced run, under 60 s")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    ns = parser.parse_args(argv)
    n = 30 if ns.quick else 100
    total = 96 if ns.quick else 320
    workspace = tempfile.mkdtemp(prefix="corral-bench-ws-", dir="/tmp")
    os.chmod(workspace, 0o755)
    try:
        user = asyncio.run(ensure_user())
        grant_tree(workspace, user.gid)
        sub = bench_subprocess(n)
        lease_s = bench_uid_lease(user, n)
        cycle_s = bench_workspace_cycle(n, 0)
        cycle_1k_s = bench_workspace_cycle(max(5, n // 5), 1000)
        bare = BareChain(workspace, user)
        try:
            with Stack(1, 1) as one:
                e2e, bw = asyncio.run(bench_e2e_and_chain(one.frontend, workspace, n, bare))
        finally:
            bare.close()
        with Stack(1, 4) as outside:
            mcp = asyncio.run(bench_mcp(outside.frontend, workspace, n))
            command = asyncio.run(bench_command_tool(outside.frontend, workspace, n))
        with Stack(4, 8) as four:
            tput = asyncio.run(bench_throughput(four.frontend, workspace, total, 32))
        images = bench_images(ns.quick)
    finally:
        shutil.rmtree(workspace, ignore_errors=True)
    results = {
        "subprocess_true_p50_ms": round(_median_ms(sub), 3),
        "bwrap_chain_true_p50_ms": round(_median_ms(bw), 3),
        "e2e_shell_true_p50_ms": round(_median_ms(e2e), 3),
        "e2e_shell_true_p90_ms": round(_p90_ms(e2e), 3),
        "uid_lease_acquire_release_p50_ms": round(_median_ms(lease_s), 3),
        "workspace_grant_release_p50_ms": round(_median_ms(cycle_s), 3),
        "workspace_grant_release_1k_entries_p50_ms": round(_median_ms(cycle_1k_s), 3),
        "calls_per_s_4_workers_32_in_flight": round(tput, 1),
        "samples": n,
        "throughput_calls": total,
        "load_1min": round(os.getloadavg()[0], 2),
        **{k: v for k, v in {**mcp, **command}.items() if not k.endswith("_vs_direct")
           and not k.endswith("_vs_shell")},
        **{k: v for k, v in images.items() if k not in IMAGE_RATIOS},
    }
    ratios = {
        "e2e_vs_bwrap": round(_median_ms(e2e) / _median_ms(bw), 3),
        "e2e_vs_subprocess": round(_median_ms(e2e) / _median_ms(sub), 3),
        "bwrap_vs_subprocess": round(_median_ms(bw) / _median_ms(sub), 3),
        "uid_lease_vs_bwrap": round(_median_ms(lease_s) / _median_ms(bw), 5),
        "workspace_grant_release_vs_bwrap": round(_median_ms(cycle_s) / _median_ms(bw), 5),
        "mcp_call_vs_direct": mcp["mcp_call_vs_direct"],
        "command_tool_vs_shell": command["command_tool_vs_shell"],
        **{k: images[k] for k in IMAGE_RATIOS if k in images},
    }
    doc = {"name": "tools", "machine": machine(), "results": results, "ratios": ratios,
           "quick": ns.quick}
    Path("bench-results").mkdir(exist_ok=True)
    Path("bench-results/tools.json").write_text(json.dumps(doc, indent=2) + "\n")
    if ns.json:
        print(json.dumps(doc))
    else:
        print_table(results, ratios, header=True)
        print("(targets: e2e_vs_bwrap <= 1.5, mcp_call_vs_direct <= 2.0, "
              "command_tool_vs_shell <= 1.2, e2e_image_vs_host <= 1.2; written to "
              "bench-results/tools.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
