"""Scale: 1,000 concurrent sessions with shell tool calls on one SessionManager,
while one session's model call hangs and another's worker is SIGKILLed; and
the memory an idle session costs (tracemalloc).
"""

from __future__ import annotations

import asyncio
import gc
import signal
import subprocess
import time
import tracemalloc
from pathlib import Path

import pytest

from supervisor.store.records import SessionId
from tests.engine.farm import _ready, engine, start_farm, write_script
from tests.helpers import PYTHON, Procs, eventually, kill_tree

N_SESSIONS = 1000
PROGRESS_WINDOW_S = 5.0  # after the kill, some session completes a turn within this


# In the heavy xdist group (tests/conftest.py). It once failed only in the
# parallel pass: the loaded machine stalled the engine's loop past the 0.5 s
# liveness window, the broker expired its client and dropped ~600 requests
# without a word, and a REQUEST cancelled in the same batch leaked worker slots.
# Both are fixed (broker/state.py _fail_expired, broker/worker.py _job_done).
@pytest.mark.slow
@pytest.mark.sandbox
@pytest.mark.timeout(420)
async def test_a_thousand_sessions_with_a_hung_one_and_a_killed_worker(
        procs: Procs, tmp_path: Path) -> None:
    # response 0: one shell call; response 1: the answer
    script = {"responses": [
        {"tool_calls": [{"name": "shell", "arguments": {"command": "echo ok"}}]},
        {"text": "finished"}]}
    farm = start_farm(procs, tmp_path, script, workers=2, capacity=64)
    hang_farm_route = farm.route("hang")
    # silence inside a stream is a provider error after read_timeout_s (120 s by
    # default): on a loaded CI machine the run outlasted two of them and the hung
    # session's third attempt failed its turn. It must stay hung for the whole test.
    hang_farm_route["read_timeout_s"] = 1800.0
    # a second scripted provider that hangs forever, for the hung session (every
    # answer hangs: if its call was on the killed worker, the retry hangs again)
    hang_script = write_script(tmp_path, {"responses": [{"hang": True}] * 8}, "hang.json")
    hang_llm = procs.spawn([PYTHON, "-m", "sandbox_worker.fakellm", "--script",
                            str(hang_script), "--port", "0"], name="hangllm",
                           stdout=subprocess.PIPE)
    hang_farm_route["base_url"] = _ready(hang_llm)["url"]
    routes = {"main": farm.route("main"), "hang": hang_farm_route}
    async with engine(farm, routes=routes) as eng:
        m = eng.manager
        hung = await eng.session(route="hang")
        sids = [await eng.session(approval="allow") for _ in range(N_SESSIONS)]
        done: dict[SessionId, str] = {}
        aborted: dict[SessionId, dict[str, object]] = {}
        done_at: list[float] = []
        all_done = asyncio.Event()
        quarter_done = asyncio.Event()

        async def watch(sid: SessionId) -> None:
            async for e in m.subscribe(sid):
                if e.type in ("turn_complete", "turn_aborted"):
                    done[sid] = e.type
                    if e.type == "turn_aborted":
                        aborted[sid] = dict(e.payload)
                    done_at.append(time.monotonic())
                    if len(done) >= N_SESSIONS // 4:
                        quarter_done.set()
                    if len(done) == N_SESSIONS:
                        all_done.set()
                    return

        started = time.monotonic()
        async with asyncio.TaskGroup() as tg:
            for sid in sids:
                tg.create_task(watch(sid))
            await m.submit(hung, {"type": "user_input", "text": "hang please"})
            for sid in sids:
                await m.submit(sid, {"type": "user_input", "text": "run echo"})
            # a worker is SIGKILLed while the load is running
            async with asyncio.timeout(200):
                await quarter_done.wait()
            quarter_s = time.monotonic() - started
            kill_tree(farm.workers[0].pid, signal.SIGKILL)
            killed_at = time.monotonic()
            async with asyncio.timeout(200):
                await all_done.wait()
        elapsed = time.monotonic() - started
        rest_s = time.monotonic() - killed_at
        # "Do not slow the others": progress never stops. Sessions keep completing
        # turns inside the killed worker's liveness window (1 s here) and the hung
        # session holds nobody up. (Counted, not timed against a rate: the rate
        # on a shared 2-core CI machine moves with whatever else runs.)
        # The window: the 1 s liveness plus a margin for a loaded CI host (3 s once saw
        # no completion with four xdist workers on 2 cores; the rest took far longer).
        in_window = sum(1 for t in done_at if killed_at <= t <= killed_at + PROGRESS_WINDOW_S)
        assert in_window > 0, \
            f"no session completed a turn in the {PROGRESS_WINDOW_S:.0f} s after the kill"
        outcomes = list(done.values())
        # sessions whose call was on the killed worker complete too (a lost model call is
        # retried; a lost tool call is "unknown"); none waits on the hung session
        assert outcomes.count("turn_complete") == N_SESSIONS, list(aborted.values())[:5]
        # still hung, bothering nobody
        assert m.sessions[hung].turn is not None, "the hung session's turn ended"
        stats = m.stats()
        assert stats["turns_running"] == 1
        counters = (await eng.client.status())["counters"]
        print(f"\n{N_SESSIONS} sessions (tool call + 2 model steps each) in {elapsed:.1f}s; "
              f"first quarter {quarter_s:.1f}s, the rest after the kill {rest_s:.1f}s, "
              f"{in_window} completed in the 3 s after the kill; broker: "
              f"{counters['worker_expiries']} worker and {counters['client_expiries']} client "
              f"expiries, {counters['failures']}")
        await m.submit(hung, {"type": "interrupt",
                              "turn_id": str(m.sessions[hung].turn.turn_id)})  # type: ignore[union-attr]


async def test_idle_sessions_are_cheap(procs: Procs, tmp_path: Path) -> None:
    farm = start_farm(procs, tmp_path, {"responses": [{"text": "x"}]}, services="model")
    n = 300
    async with engine(farm) as eng:
        await eng.session()  # warm caches (imports, first-use allocations)
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.take_snapshot()
            for _ in range(n):
                await eng.session()

            async def all_idle() -> bool:
                return all(s.driver is None for s in eng.manager.sessions.values())
            await eventually(all_idle, timeout_s=30, what="every session idle")
            gc.collect()
            after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        diff = sum(s.size_diff for s in after.compare_to(before, "filename"))
        per_session = diff / n
        print(f"\nidle session: {per_session / 1024:.1f} KiB (tracemalloc, {n} sessions)")
        assert per_session < 50 * 1024
        assert eng.manager.stats()["sessions_idle"] == n + 1
