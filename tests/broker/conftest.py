"""Fixtures of the broker tests: real broker and echo-worker processes on real sockets.

Endpoints are ipc:// paths in a short per-test directory (Unix socket paths
are limited to ~107 bytes, and pytest's tmp_path can be longer), so tests are
safe under xdist and a broker can be restarted on the same endpoint.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import BrokerProc, Procs, read_line_with_deadline, read_ready, spawn_broker

HB_S = 0.25  # heartbeat interval used by the tests
LIVENESS = 3  # 0.75 s window: kill detection within 3 intervals + 0.5 s


@dataclass
class EchoProc:
    proc: subprocess.Popen[bytes]
    identity: str

    def event(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """The next JSON event line the worker printed (needs ``--events``)."""
        line = read_line_with_deadline(self.proc, timeout_s)
        return dict(json.loads(line))


@pytest.fixture
def ipc_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cb-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def start_broker(procs: Procs, frontend: str, backend: str, *extra: str,
                 hb_s: float = HB_S, liveness: int = LIVENESS) -> BrokerProc:
    return spawn_broker(procs, "--frontend", frontend, "--backend", backend,
                        "--heartbeat-interval-s", str(hb_s), "--liveness", str(liveness), *extra)


def start_echo(procs: Procs, backend: str, *extra: str, capacity: int = 1,
               hb_s: float = HB_S, liveness: int = LIVENESS) -> EchoProc:
    proc = procs.python(
        "broker.echo", "--backend", backend, "--capacity", str(capacity),
        "--heartbeat-interval-s", str(hb_s), "--liveness", str(liveness), *extra,
        name="echo", stdout=subprocess.PIPE,
    )
    return EchoProc(proc, str(read_ready(proc)["identity"]))


@pytest.fixture
def broker(procs: Procs, ipc_dir: Path) -> BrokerProc:
    return start_broker(procs, f"ipc://{ipc_dir}/front", f"ipc://{ipc_dir}/back")


def stop_gracefully(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=timeout_s)


