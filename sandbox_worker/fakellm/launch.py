"""Starting the scripted provider as a child process, for the farm and tests.

``start_fake_llm(script)`` spawns ``python -m sandbox_worker.fakellm`` in its
own session, waits for its JSON ready line under a deadline (a handshake, not
a sleep) and returns a handle with the URL. ``stop()`` sends SIGTERM, waits a
grace period, then SIGKILLs, and always reaps.

Invariants:
- The child never outlives a failed start: on any error before ready it is
  killed and reaped before ``FakeLLMStartError`` is raised.
- The child inherits no API key: its environment drops every variable whose
  name looks like a credential.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from sandbox_worker.model.secrets import SECRET_NAME_HINTS


class FakeLLMStartError(RuntimeError):
    """The scripted provider did not report ready in time."""


@dataclass
class FakeLLMProcess:
    proc: subprocess.Popen[bytes]
    url: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, grace_s: float = 3.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
        self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _read_line(stream: IO[bytes], deadline: float) -> bytes:
    sel = selectors.DefaultSelector()
    sel.register(stream, selectors.EVENT_READ)
    buf = b""
    try:
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise FakeLLMStartError("no ready line before the deadline")
            chunk = os.read(stream.fileno(), 4096)
            if not chunk:
                raise FakeLLMStartError("the process exited before it was ready")
            buf += chunk
    finally:
        sel.close()
    return buf


def start_fake_llm(script: Path, *, host: str = "127.0.0.1", port: int = 0,
                   log_path: Path | None = None, ready_timeout_s: float = 15.0,
                   python: str = sys.executable) -> FakeLLMProcess:
    """Start the scripted provider serving ``script``; return its handle and URL."""
    env = {k: v for k, v in os.environ.items()
           if not any(h in k.upper() for h in SECRET_NAME_HINTS)}
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    try:
        proc = subprocess.Popen(
            [python, "-m", "sandbox_worker.fakellm", "--script", str(script),
             "--host", host, "--port", str(port)],
            stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True)
    finally:
        if log_path and not isinstance(log, int):
            log.close()
    try:
        if proc.stdout is None:
            raise FakeLLMStartError("no stdout pipe")
        line = _read_line(proc.stdout, time.monotonic() + ready_timeout_s)
        try:
            ready = json.loads(line)
        except ValueError:
            ready = None
        if not isinstance(ready, dict) or ready.get("event") != "ready":
            raise FakeLLMStartError(f"unexpected first line: {line[:200]!r}")
        return FakeLLMProcess(proc, str(ready["url"]))
    except BaseException:
        proc.kill()
        proc.wait(timeout=10)
        raise
