"""The supervisor's broker identity is the same for every process on one store,
so the broker drops a killed supervisor's requests when its successor says hello
(``client_restarts``, tests/broker/test_state.py) instead of after a client window."""

from __future__ import annotations

from pathlib import Path

from supervisor.main import broker_identity


def test_one_store_one_identity(tmp_path: Path) -> None:
    a = tmp_path / "a" / "corral.db"
    assert broker_identity(a) == broker_identity(tmp_path / "a" / ".." / "a" / "corral.db")
    assert broker_identity(a) != broker_identity(tmp_path / "b" / "corral.db")
    assert broker_identity(a).startswith(b"c-supervisor-")
    assert len(broker_identity(a)) <= 255  # a ZeroMQ routing id
