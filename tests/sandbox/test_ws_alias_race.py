"""Calls that start together on several workers mount one alias, not one each.

Each worker thread here does what a call's start does (``wsalias.alias_for``)
for the same workspace at the same moment (a barrier), on the host's real
mount table; then each ends as a call ends (``wsalias.release``). Every
round must show exactly one mount at the alias while they hold it, and none
once the last has ended: a second layer would survive the last call's
detach (seen once in a parallel suite run, before the mount was made under
its own exclusive lock).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sandbox_worker.sandbox import wsalias

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(os.geteuid() != 0, reason="mounting an alias needs root")]

CALLERS = 4
ROUNDS = 25
# Outside the default workspace gid range (200000:65536), so no worker of
# another test can hold this alias's gid.
GID = 190_000 + os.getpid() % 5_000


def layers(target: str) -> int:
    with open("/proc/self/mountinfo") as f:
        return sum(1 for line in f if line.split()[4] == target)


@pytest.fixture
def pinned(tmp_path: Path) -> Iterator[tuple[int, tuple[int, int]]]:
    ws = tmp_path / "ws"
    ws.mkdir()
    fd = os.open(ws, os.O_RDONLY | os.O_DIRECTORY)
    st = os.fstat(fd)
    try:
        yield fd, (st.st_dev, st.st_ino)
    finally:
        os.close(fd)
        target = f"{wsalias.ALIAS_ROOT}/{GID}/ws"
        while layers(target):  # a failed round's leftovers
            if not wsalias._detach(target):
                break


def test_calls_starting_together_mount_the_alias_once(
        pinned: tuple[int, tuple[int, int]]) -> None:
    fd, identity = pinned
    target = f"{wsalias.ALIAS_ROOT}/{GID}/ws"
    with ThreadPoolExecutor(CALLERS) as pool:
        for n in range(ROUNDS):
            barrier = threading.Barrier(CALLERS, timeout=10)

            def start(barrier: threading.Barrier = barrier) -> wsalias.Alias:
                barrier.wait()
                return wsalias.alias_for(fd, GID, identity)

            aliases = list(pool.map(lambda _: start(), range(CALLERS), timeout=20))
            try:
                assert layers(target) == 1, f"round {n}: {layers(target)} mounts at the alias"
                assert {a.path for a in aliases} == {target}
            finally:
                detached = [wsalias.release(a) for a in aliases]
            assert detached.count(True) == 1, detached
            assert layers(target) == 0, f"round {n}: the alias outlived its last call"
