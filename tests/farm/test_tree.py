"""The farm's supervision tree with real child processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from supervisor.farm.tree import ChildFailedToStart, ChildSpec, Escalation, SupervisionTree
from tests.helpers import eventually

CHILD = textwrap.dedent("""
    import json, os, signal, subprocess, sys, time
    name, order_file = sys.argv[1], sys.argv[2]
    def term(*_):
        with open(order_file, "a") as f:
            f.write(name + "\\n")
        sys.exit(0)
    signal.signal(signal.SIGTERM, term)
    if len(sys.argv) > 3 and sys.argv[3] == "grandchild":
        subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    print(json.dumps({"event": "ready", "name": name, "pid": os.getpid()}), flush=True)
    while True:
        signal.pause()  # SIGTERM's handler exits
""")


def spec(tmp_path: Path, name: str, *extra: str, **kw: object) -> ChildSpec:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return ChildSpec(name, [sys.executable, str(script), name, str(tmp_path / "order"), *extra],
                     shutdown_timeout_s=3.0, **kw)  # type: ignore[arg-type]


async def test_children_start_in_order_and_stop_in_reverse(tmp_path: Path) -> None:
    tree = SupervisionTree([spec(tmp_path, n) for n in ("broker", "supervisor", "worker")],
                           log_dir=tmp_path / "logs")
    await tree.start()
    pids = [c.pid for c in tree.children.values()]
    assert all(p and psutil.pid_exists(p) for p in pids)
    assert [c.ready["name"] for c in tree.children.values()] == ["broker", "supervisor",
                                                                 "worker"]
    await tree.stop()
    assert (tmp_path / "order").read_text().split() == ["worker", "supervisor", "broker"]
    assert not any(p and psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                   for p in pids)


async def test_a_killed_child_is_restarted_and_grandchildren_swept(tmp_path: Path) -> None:
    tree = SupervisionTree([spec(tmp_path, "a"), spec(tmp_path, "b", "grandchild")],
                           log_dir=tmp_path / "logs")
    ready = asyncio.Event()
    task = asyncio.create_task(tree.run(on_ready=ready.set))
    try:
        await asyncio.wait_for(ready.wait(), 20)
        b = tree.children["b"]
        old_pid = b.pid
        assert old_pid is not None
        grandchildren = psutil.Process(old_pid).children()
        assert grandchildren
        os.kill(old_pid, signal.SIGKILL)

        async def restarted() -> bool:
            return b.pid != old_pid and b.state == "running"

        await eventually(restarted, timeout_s=20, what="child b restarted")
        assert b.restarts == 1
        await eventually(lambda: _gone(grandchildren[0].pid), timeout_s=10,
                         what="the dead child's grandchild swept")
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert all(c.state == "stopped" for c in tree.children.values())


async def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def test_restart_intensity_escalates_and_stops_everything(tmp_path: Path) -> None:
    crashing = ChildSpec("crashy", [sys.executable, "-c",
                                    "import json; print(json.dumps({'event': 'ready'}), "
                                    "flush=True); raise SystemExit(3)"])
    tree = SupervisionTree([spec(tmp_path, "steady"), crashing], log_dir=tmp_path / "logs",
                           max_restarts=3, within_s=60)
    with pytest.raises(ExceptionGroup) as info:
        await asyncio.wait_for(tree.run(), 60)
    escalations = info.value.subgroup(Escalation)
    assert escalations is not None
    message = str(escalations.exceptions[0])
    assert "crashy" in message
    assert "exit code 3" in message
    steady = tree.children["steady"]
    assert steady.proc is not None
    assert steady.proc.returncode is not None


async def test_a_child_that_never_gets_ready_fails_the_start_cleanly(tmp_path: Path) -> None:
    silent = ChildSpec("silent", [sys.executable, "-c", "import signal; signal.pause()"],
                       ready_timeout_s=1.0)
    tree = SupervisionTree([spec(tmp_path, "first"), silent], log_dir=tmp_path / "logs")
    with pytest.raises(ChildFailedToStart, match="silent did not report ready"):
        await tree.start()
    for child in tree.children.values():
        assert child.proc is None or child.proc.returncode is not None


def test_children_stop_when_the_farm_root_is_sigkilled(tmp_path: Path) -> None:
    """A farm root killed without stopping its children leaves no orphan: each
    child's lifeline notices the new parent and stops it."""
    import json as _json
    import subprocess as _subprocess

    home = tmp_path / "home"
    home.mkdir()
    (home / "corral.toml").write_text("[sandbox]\ntier_min = 'T0'\nallow_unsandboxed = true\n")
    root = _subprocess.Popen([sys.executable, "-m", "supervisor.farm", "--home", str(home),
                              "--workers", "1"], stdout=_subprocess.DEVNULL,
                             stderr=_subprocess.DEVNULL, start_new_session=True)
    try:
        farm_json = home / "farm.json"
        deadline = time.monotonic() + 90
        while not farm_json.exists() and time.monotonic() < deadline and root.poll() is None:
            time.sleep(0.05)
        info = _json.loads(farm_json.read_text())
        pids = [c["pid"] for c in info["children"]]
        assert pids
        os.kill(root.pid, signal.SIGKILL)
        root.wait(10)
        deadline = time.monotonic() + 30
        alive = pids
        while alive and time.monotonic() < deadline:
            alive = [p for p in pids if not _gone_now(p)]
            time.sleep(0.05)
        assert not alive, f"children outlived their root: {alive}"
    finally:
        for pid in [root.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def _gone_now(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def test_a_chatty_child_log_stays_bounded(tmp_path: Path) -> None:
    chatty = ChildSpec("chatty", [sys.executable, "-c",
                                  "import json, sys, time\n"
                                  "print(json.dumps({'event': 'ready'}), flush=True)\n"
                                  "while True:\n"
                                  "    sys.stderr.write('x' * 1023 + '\\n'); sys.stderr.flush()\n"
                                  "    time.sleep(0.0005)\n"])
    tree = SupervisionTree([chatty], log_dir=tmp_path / "logs", max_log_bytes=200_000)
    ready = asyncio.Event()
    task = asyncio.create_task(tree.run(on_ready=ready.set))
    log = tmp_path / "logs" / "chatty.log"
    try:
        await asyncio.wait_for(ready.wait(), 20)

        async def rotated() -> bool:
            return log.with_name("chatty.log.1").exists()

        await eventually(rotated, timeout_s=30, what="the log to rotate")

        async def truncated() -> bool:  # the copy is whole once the live log was cut
            return log.stat().st_size < log.with_name("chatty.log.1").stat().st_size

        await eventually(truncated, timeout_s=30, what="the rotated log to be truncated")
        # Bounded by the limit plus what one check interval lets through.
        assert log.with_name("chatty.log.1").stat().st_size < 50_000_000
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_stage_starts_together_after_the_stage_before_is_ready(tmp_path: Path) -> None:
    # Each child of stage 1 waits for a file the other creates: sequentially they
    # could never both get ready. The stage-0 child's ready line is passed on.
    gate = textwrap.dedent("""
        import json, os, sys, time
        mine, other = sys.argv[1], sys.argv[2]
        open(mine, "w").close()
        deadline = time.monotonic() + 20
        while not os.path.exists(other):
            if time.monotonic() > deadline:
                sys.exit(4)
            time.sleep(0.01)
        print(json.dumps({"event": "ready", "seen": sys.argv[3]}), flush=True)
        import signal
        signal.pause()
    """)
    (tmp_path / "gate.py").write_text(gate)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")

    def gated(name: str, mine: str, other: str) -> ChildSpec:
        base = [sys.executable, str(tmp_path / "gate.py"), mine, other]
        return ChildSpec(name, base, stage=1, ready_timeout_s=30.0,
                         dynamic_argv=lambda ready: [*base, str(ready["first"]["pid"])])

    tree = SupervisionTree([spec(tmp_path, "first", stage=0), gated("x", a, b),
                            gated("y", b, a)], log_dir=tmp_path / "logs")
    assert [[c.spec.name for c in s] for s in tree.stages()] == [["first"], ["x", "y"]]
    await tree.start()
    try:
        first = tree.children["first"].pid
        assert tree.children["x"].ready["seen"] == tree.children["y"].ready["seen"] == str(first)
    finally:
        await tree.stop()


async def test_a_failure_in_a_stage_stops_its_siblings_too(tmp_path: Path) -> None:
    bad = ChildSpec("bad", [sys.executable, "-c", "raise SystemExit(5)"], stage=1)
    tree = SupervisionTree([spec(tmp_path, "first"), spec(tmp_path, "sibling", stage=1), bad],
                           log_dir=tmp_path / "logs")
    with pytest.raises(ChildFailedToStart, match="bad failed to start"):
        await tree.start()
    for child in tree.children.values():
        assert child.proc is not None, child.spec.name
        assert child.proc.returncode is not None, child.spec.name


async def test_a_stop_group_stops_together_after_the_child_started_last(
        tmp_path: Path) -> None:
    # On SIGTERM each worker waits for the other's SIGTERM before it exits: one
    # at a time, the first would wait out its shutdown timeout and be killed.
    script = textwrap.dedent("""
        import json, os, signal, sys, time
        name, mine, other, order = sys.argv[1:5]
        def term(*_):
            open(mine, "w").close()
            deadline = time.monotonic() + 10
            while not os.path.exists(other):
                if time.monotonic() > deadline:
                    sys.exit(4)
                time.sleep(0.01)
            with open(order, "a") as f:
                f.write(name + "\\n")
            sys.exit(0)
        signal.signal(signal.SIGTERM, term)
        print(json.dumps({"event": "ready"}), flush=True)
        while True:
            signal.pause()
    """)
    (tmp_path / "w.py").write_text(script)
    order = str(tmp_path / "order")

    def worker(name: str, mine: str, other: str) -> ChildSpec:
        return ChildSpec(name, [sys.executable, str(tmp_path / "w.py"), name,
                                str(tmp_path / mine), str(tmp_path / other), order],
                         stop_group="workers", shutdown_timeout_s=3.0)

    tree = SupervisionTree([spec(tmp_path, "broker"), worker("w1", "a", "b"),
                            worker("w2", "b", "a"), spec(tmp_path, "supervisor")],
                           log_dir=tmp_path / "logs")
    await tree.start()
    await tree.stop()
    stopped = (tmp_path / "order").read_text().split()
    assert stopped[0] == "supervisor"
    assert sorted(stopped[1:3]) == ["w1", "w2"]
    assert stopped[3] == "broker"
