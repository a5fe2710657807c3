"""Fixtures of the multi-host tests: key material for a farm, and a CURVE broker.

Keys are written with ``broker.security`` exactly as ``corral keys`` writes
them: the broker's and the supervisor's pairs, a worker pair and a client pair
on the allow-list, and a stranger pair that is not.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from broker.security import CurveClient, read_key_file, write_allowed, write_key_pair
from tests.helpers import BrokerProc, Procs, spawn_broker
from tests.multihost.netns import hosts  # noqa: F401 (the fixture)

HB_S = 0.25
LIVENESS = 3


@dataclass
class FarmKeys:
    root: Path
    allow_dir: Path

    def pub(self, name: str) -> Path:
        return self.root / f"{name}.key"

    def secret(self, name: str) -> Path:
        return self.root / f"{name}.key_secret"

    def client(self, name: str, server: str = "broker") -> CurveClient:
        return CurveClient.from_files(self.pub(server), self.secret(name))

    def allow(self, name: str, role: str, tenant: str | None = None) -> Path:
        return write_allowed(self.allow_dir, name, read_key_file(self.pub(name)).public,
                             role=role, tenant=tenant)


@pytest.fixture
def keys(tmp_path: Path) -> FarmKeys:
    fk = FarmKeys(tmp_path / "keys", tmp_path / "allowed")
    for name in ("broker", "supervisor", "worker1", "worker2", "alice", "bob", "stranger"):
        write_key_pair(fk.root, name)
    fk.allow("supervisor", "supervisor")
    fk.allow("worker1", "worker")
    fk.allow("worker2", "worker")
    fk.allow("alice", "client", tenant="a")
    fk.allow("bob", "client", tenant="b")
    return fk


def start_curve_broker(procs: Procs, keys: FarmKeys, *, frontend: str = "tcp://127.0.0.1:0",
                       backend: str = "tcp://127.0.0.1:0", prefix: list[str] | None = None,
                       log_level: str = "INFO", extra: list[str] | None = None) -> BrokerProc:
    return spawn_broker(
        procs, "--frontend", frontend, "--backend", backend, "--heartbeat-interval-s",
        str(HB_S), "--liveness", str(LIVENESS), "--curve-secret", str(keys.secret("broker")),
        "--allow-dir", str(keys.allow_dir), "--log-level", log_level, *(extra or []),
        prefix=prefix or ())


