"""Start the processes of a CURVE farm by hand, each optionally inside a network
namespace (``prefix=["ip", "netns", "exec", NS]``), through the ``procs`` fixture.

The farm's keys come from ``supervisor.keys`` exactly as ``corral keys`` makes
them; worker and client keys are written next to them and allowed.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from broker.security import CurveClient
from supervisor.keys import allow, ensure_farm_keys, farm_keys, new_key
from tests.helpers import PYTHON, Procs, read_line_with_deadline

HB_S = 0.25
LIVENESS = 4  # a 1 s liveness window

SCRIPT_TOOL = {"responses": [
    {"tool_calls": [{"name": "shell",
                     "arguments": {"command": "echo $(hostname) >> hosts.txt; echo ok"}}]},
    {"text": "done", "usage": {"input": 10, "output": 3}},
]}


@dataclass
class Farm:
    home: Path
    procs: Procs
    ready: dict[str, dict[str, Any]] = field(default_factory=dict)
    proc: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def keys_dir(self) -> Path:
        return farm_keys(self.home).directory

    def client_keys(self, name: str) -> CurveClient:
        fk = farm_keys(self.home)
        return CurveClient.from_files(fk.public("supervisor"), fk.secret(name))

    def spawn(self, name: str, argv: list[str], prefix: list[str] | None = None,
              timeout_s: float = 60.0) -> dict[str, Any]:
        proc = self.procs.spawn([*(prefix or []), *argv], name=name, stdout=subprocess.PIPE)
        self.proc[name] = proc
        line = read_line_with_deadline(proc, timeout_s)
        ready = dict(json.loads(line))
        self.ready[name] = ready
        return ready

    def broker(self, front: str, back: str, prefix: list[str] | None = None,
               name: str = "broker") -> dict[str, Any]:
        fk = farm_keys(self.home)
        return self.spawn(name, [
            PYTHON, "-m", "broker", "--frontend", front, "--backend", back,
            "--heartbeat-interval-s", str(HB_S), "--liveness", str(LIVENESS),
            "--curve-secret", str(fk.secret("broker")), "--allow-dir", str(fk.allow_dir),
            "--log-level", "INFO"], prefix)

    def fakellm(self, host: str, prefix: list[str] | None = None) -> str:
        ready = self.spawn("fakellm", [PYTHON, "-m", "sandbox_worker.fakellm", "--script",
                                       str(self.home / "script.json"), "--host", host,
                                       "--port", "0"], prefix)
        return str(ready["url"])

    def worker(self, name: str, backend: str, prefix: list[str] | None = None,
               capacity: int = 2) -> dict[str, Any]:
        fk = farm_keys(self.home)
        return self.spawn(name, [
            PYTHON, "-m", "supervisor.cli", "worker", "--broker", backend,
            "--server-key", str(fk.public("broker")), "--key", str(fk.secret(name)),
            "--capacity", str(capacity), "--tier-min", "T1",
            "--heartbeat-interval-s", str(HB_S), "--liveness", str(LIVENESS)], prefix,
            timeout_s=90.0)

    def supervisor(self, frontend: str, listen: str, route_url: str,
                   prefix: list[str] | None = None) -> dict[str, Any]:
        return self.spawn("supervisor", [
            PYTHON, "-m", "supervisor", "--home", str(self.home), "--broker", frontend,
            "--listen", listen, "--curve", "--route-url", f"s={route_url}",
            "--heartbeat-interval-s", str(HB_S), "--liveness", str(LIVENESS)], prefix)


def make_home(home: Path, *, workers: tuple[str, ...] = ("worker1", "worker2"),
              clients: dict[str, str | None] | None = None,
              script: dict[str, Any] | None = None) -> Path:
    """A farm home: corral.toml, the script, the farm keys, allowed worker/client keys."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "script.json").write_text(json.dumps(script or SCRIPT_TOOL))
    (home / "corral.toml").write_text(
        '[session]\ndefault_route = "s"\napproval = "allow"\n[sandbox]\ntier_min = "T1"\n'
        '[routes.s]\nscript = "script.json"\nread_timeout_s = 5.0\n')
    fk = ensure_farm_keys(home)
    for name in workers:
        new_key(name, fk.directory)
        allow(fk.public(name), home, role="worker")
    for name, tenant in (clients or {}).items():
        new_key(name, fk.directory)
        allow(fk.public(name), home, role="client", tenant=tenant)
    # Everything under /tmp/... must be readable by the processes in the namespaces
    # (same root user, so modes are fine as written).
    return home
