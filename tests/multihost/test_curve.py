"""CURVE + ZAP on the broker's TCP endpoints: allowed keys get in, everything else
is rejected (and logged once per peer and reason) without disturbing other traffic."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from broker.client import BrokerClient
from broker.echo import SERVICE, make_echo_handler
from broker.security import CurveClient, CurveServer, read_key_file
from broker.server import Broker, BrokerConfig
from broker.state import Limits
from broker.worker import BrokerWorker
from tests.helpers import Procs, eventually
from tests.multihost.conftest import HB_S, LIVENESS, FarmKeys, start_curve_broker

UNKNOWN = "unknown key (not on the allow-list)"
PLAIN = "plain-text or other-mechanism peer on a CURVE endpoint"
WRONG_SERVER = "cryptographic failure: the peer has the wrong server key"


def _worker(endpoint: str, curve: CurveClient | None) -> BrokerWorker:
    return BrokerWorker(endpoint, {SERVICE: make_echo_handler()}, capacity=2,
                        heartbeat_interval_s=HB_S, liveness=LIVENESS, curve=curve)


@contextlib.asynccontextmanager
async def _running(worker: BrokerWorker) -> AsyncIterator[BrokerWorker]:
    async with asyncio.TaskGroup() as tg:
        tg.create_task(worker.run())
        try:
            yield worker
        finally:
            await worker.stop(drain_s=0.5)


async def _worker_count(client: BrokerClient) -> int:
    status = await client.status(timeout_s=2.0)
    return int(status["worker_count"])


async def test_allowed_keys_serve_and_strangers_are_refused(procs: Procs,
                                                            keys: FarmKeys) -> None:
    broker = start_curve_broker(procs, keys)
    assert broker.frontend.startswith("tcp://")
    stranger = CurveClient.from_files(keys.pub("broker"), keys.secret("stranger"))
    wrong_server = CurveClient.from_files(keys.pub("worker2"), keys.secret("worker2"))
    async with (BrokerClient(broker.frontend, curve=keys.client("supervisor"),
                             heartbeat_interval_s=HB_S, liveness=LIVENESS) as client,
                _running(_worker(broker.backend, keys.client("worker1"))) as good):
        await eventually(lambda: _ready(good), timeout_s=10, what="allowed worker registered")
        assert await client.request(SERVICE, b"hello", budget_s=5) == b"hello"
        async with (_running(_worker(broker.backend, stranger)) as w_unknown,
                    _running(_worker(broker.backend, None)) as w_plain,
                    _running(_worker(broker.backend, wrong_server)) as w_wrong):
            log = procs.log(broker.proc)
            for _ in range(3):
                # Traffic keeps flowing while the rejected peers keep retrying.
                assert await client.request(SERVICE, b"still", budget_s=5) == b"still"

            async def all_rejected() -> bool:
                text = procs.log(broker.proc)
                return all(r in text for r in (UNKNOWN, PLAIN, WRONG_SERVER))

            await eventually(all_rejected, timeout_s=10, what="three rejections logged")
            assert await _worker_count(client) == 1
            for w in (w_unknown, w_plain, w_wrong):
                assert w.phase in ("registering", "backoff"), w.phase  # never "ready"
                assert w.broker_id is None
        log = procs.log(broker.proc)
        stranger_pub = read_key_file(keys.pub("stranger")).public.decode()
        assert stranger_pub in log  # the unknown key is named in the log
        assert await client.request(SERVICE, b"after", budget_s=5) == b"after"


async def _ready(worker: BrokerWorker) -> bool:
    return worker.phase == "ready"


async def test_a_worker_key_cannot_be_a_broker_client(procs: Procs, keys: FarmKeys) -> None:
    """Roles: the frontend admits supervisor keys only, the backend worker keys only."""
    broker = start_curve_broker(procs, keys)
    async with BrokerClient(broker.frontend, curve=keys.client("worker1"),
                            heartbeat_interval_s=HB_S, liveness=LIVENESS) as client:
        await eventually(lambda: _logged(procs, broker, "key worker1 has role worker"),
                         timeout_s=10, what="role refusal logged")
        assert not client.connected
    async with _running(_worker(broker.backend, keys.client("supervisor"))) as w:
        await eventually(lambda: _logged(procs, broker, "key supervisor has role supervisor"),
                         timeout_s=10, what="role refusal logged")
        assert w.phase in ("registering", "backoff")  # never "ready"


async def _logged(procs: Procs, broker: object, text: str) -> bool:
    return text in procs.log(broker.proc)  # type: ignore[attr-defined]


async def test_allow_list_reloads_without_restart(procs: Procs, keys: FarmKeys) -> None:
    broker = start_curve_broker(procs, keys)
    newcomer = keys.root / "newcomer"
    from broker.security import write_key_pair

    write_key_pair(keys.root, "newcomer")
    async with (BrokerClient(broker.frontend, curve=keys.client("supervisor"),
                             heartbeat_interval_s=HB_S, liveness=LIVENESS) as client,
                _running(_worker(broker.backend, keys.client("newcomer"))) as w):
        await eventually(lambda: _logged(procs, broker, UNKNOWN), timeout_s=10,
                         what="newcomer refused first")
        assert w.phase in ("registering", "backoff")  # never "ready"
        keys.allow("newcomer", "worker")  # no restart, no signal: the directory changed
        await eventually(lambda: _ready(w), timeout_s=10, what="newcomer admitted after allow")
        assert await client.request(SERVICE, b"x", budget_s=5) == b"x"
    assert newcomer.with_suffix(".key").exists()


async def test_rejections_are_logged_once_per_peer(keys: FarmKeys,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A peer retrying a refused handshake many times gives one log line, many counts."""
    caplog.set_level(logging.WARNING, logger="broker.security")
    server = CurveServer.from_files(keys.secret("broker"), keys.allow_dir)
    broker = Broker(BrokerConfig("tcp://127.0.0.1:0", "tcp://127.0.0.1:0",
                                 Limits(heartbeat_interval_s=HB_S, liveness=LIVENESS),
                                 curve=server))
    _front, back = broker.bind()
    assert broker.guard is not None
    guard = broker.guard
    thread = threading.Thread(target=broker.run, name="broker-loop")
    thread.start()
    stranger = CurveClient.from_files(keys.pub("broker"), keys.secret("stranger"))
    try:
        async with _running(_worker(back, stranger)), _running(_worker(back, None)):
            await eventually(lambda: _counted(guard.rejected, UNKNOWN, PLAIN, at_least=3),
                             timeout_s=20, what="several retries of each refused peer")
    finally:
        broker.request_stop()
        thread.join(timeout=10)
        broker.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "broker.security"]
    assert sum(UNKNOWN in line for line in lines) == 1, lines
    assert sum(PLAIN in line for line in lines) == 1, lines


async def _counted(counter: object, *reasons: str, at_least: int) -> bool:
    return all(counter[r] >= at_least for r in reasons)  # type: ignore[index]


def test_key_files_have_safe_modes(keys: FarmKeys) -> None:
    assert keys.secret("worker1").stat().st_mode & 0o777 == 0o600
    assert keys.pub("worker1").stat().st_mode & 0o077 in (0o044, 0o004, 0o040, 0)
    kf = read_key_file(keys.allow_dir / "alice.key")
    assert (kf.role, kf.tenant, kf.secret) == ("client", "a", None)
    import zmq.auth

    public, secret = zmq.auth.load_certificate(str(keys.secret("worker1")))
    assert secret is not None
    assert public == read_key_file(keys.pub("worker1")).public




async def test_ipc_stays_plain_beside_a_curve_tcp_endpoint(procs: Procs,
                                                            keys: FarmKeys) -> None:
    """One socket, two binds: ipc:// plain for local workers, tcp:// CURVE for remote."""
    run = Path(tempfile.mkdtemp(prefix="cmh-", dir="/tmp"))
    try:
        broker = start_curve_broker(procs, keys, frontend=f"ipc://{run}/f",
                                    backend=f"ipc://{run}/b",
                                    extra=["--backend-tcp", "tcp://127.0.0.1:0"])
        tcp_backend = broker.ready["tcp"]["backend"]
        assert tcp_backend.startswith("tcp://127.0.0.1:")
        async with (BrokerClient(broker.frontend, heartbeat_interval_s=HB_S,
                                 liveness=LIVENESS) as client,
                    _running(_worker(broker.backend, None)) as local,
                    _running(_worker(tcp_backend, keys.client("worker1"))) as remote,
                    _running(_worker(tcp_backend, None)) as plain_tcp):
            await eventually(lambda: _ready(local), timeout_s=10, what="plain ipc worker")
            await eventually(lambda: _ready(remote), timeout_s=10, what="CURVE tcp worker")
            await eventually(lambda: _logged(procs, broker, PLAIN), timeout_s=10,
                             what="plain tcp worker refused")
            assert plain_tcp.phase in ("registering", "backoff")  # never "ready"
            assert await _worker_count(client) == 2
            for _ in range(4):
                assert await client.request(SERVICE, b"x", budget_s=5) == b"x"
    finally:
        shutil.rmtree(run, ignore_errors=True)


async def test_sighup_rereads_the_allow_list(procs: Procs, keys: FarmKeys) -> None:
    """An in-place edit does not change the directory's mtime; SIGHUP makes it count."""
    broker = start_curve_broker(procs, keys)
    entry = keys.allow_dir / "worker2.key"
    text = entry.read_text()
    entry.write_text(text.replace('role = "worker"', 'role = "client"'))  # in place
    keys.allow_dir.touch()  # the broker reloads once: worker2 is now a client key
    async with _running(_worker(broker.backend, keys.client("worker2"))) as w:
        await eventually(lambda: _logged(procs, broker, "key worker2 has role client"),
                         timeout_s=10, what="worker2 refused as a client key")
        stamp = keys.allow_dir.stat().st_mtime_ns
        entry.write_text(text)  # back to role worker, in place: the mtime stays
        os.utime(keys.allow_dir, ns=(stamp, stamp))
        broker.proc.send_signal(signal.SIGHUP)
        await eventually(lambda: _ready(w), timeout_s=10, what="worker2 admitted after SIGHUP")
