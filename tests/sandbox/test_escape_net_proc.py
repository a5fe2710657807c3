"""Network, process, secret and cancellation probes through the real broker,
worker and sandbox. Each asserts on the tool result and on the host's state."""

from __future__ import annotations

import asyncio
import select
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from broker.client import BrokerClient
from broker.protocol import unpack
from tests.helpers import Procs, wait_until
from tests.sandbox.conftest import (
    FAKE_KEY,
    Stack,
    call_processes,
    needs_system_python,
    no_call_processes,
    request_body,
    shell,
)

pytestmark = pytest.mark.sandbox


@dataclass
class Listener:
    tcp: socket.socket
    udp: socket.socket

    @property
    def tcp_port(self) -> int:
        return int(self.tcp.getsockname()[1])

    @property
    def udp_port(self) -> int:
        return int(self.udp.getsockname()[1])

    def observed(self, wait_s: float) -> list[str]:
        """What reached the listener within ``wait_s`` (a select with a deadline)."""
        seen: list[str] = []
        ready, _, _ = select.select([self.tcp, self.udp], [], [], wait_s)
        if self.tcp in ready:
            conn, _ = self.tcp.accept()
            seen.append("tcp")
            conn.close()
        if self.udp in ready:
            self.udp.recvfrom(65536)
            seen.append("udp")
        return seen


@pytest.fixture
def listener() -> Iterator[Listener]:
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(8)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    try:
        yield Listener(tcp, udp)
    finally:
        tcp.close()
        udp.close()


async def test_network_is_closed_by_default(client: BrokerClient, workspace: Path,
                                            listener: Listener) -> None:
    needs_system_python()
    cmd = (f"echo hello > /dev/tcp/127.0.0.1/{listener.tcp_port}; echo tcp=$?; "
           f"echo hello > /dev/udp/127.0.0.1/{listener.udp_port}; "
           f"python3 -c \"import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
           f"s.sendto(b'x', ('127.0.0.1', {listener.udp_port}))\"")
    res = await shell(client, cmd, workspace)
    assert "tcp=1" in res.result["output"]
    assert res.result["isolation"]["network"] == "none"
    # UDP to 127.0.0.1 may "succeed" into the sandbox's own loopback; the host
    # listener must still see nothing.
    assert listener.observed(0.3) == []


async def test_granted_network_reaches_the_host(client: BrokerClient, workspace: Path,
                                                listener: Listener) -> None:
    cmd = f"echo hello > /dev/tcp/127.0.0.1/{listener.tcp_port}"
    res = await shell(client, cmd, workspace, {"network": True})
    assert not res.result["is_error"], res.result["output"]
    assert res.result["isolation"]["network"] == "granted"
    assert "tcp" in listener.observed(5.0)


async def test_granted_network_does_not_reach_host_abstract_sockets(
        stack: Stack, client: BrokerClient, workspace: Path, listener: Listener) -> None:
    """A network grant at T2 shares the host's network namespace, and with it
    the host's abstract unix sockets (an X server's, a desktop bus's): a
    granted call connected to a host listener on one. The chain now scopes
    abstract sockets to the call (Landlock, ABI >= 6) before bwrap; T1 always
    did. TCP to the host still works on the grant."""
    needs_system_python()
    if not stack.info.get("landlock_abi", 0) >= 6:
        pytest.skip("Landlock cannot scope abstract unix sockets here (ABI < 6)")
    name = f"corral-abstract-{uuid.uuid4().hex[:12]}"
    host = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    host.bind("\0" + name)
    host.listen(4)
    try:
        cmd = ("python3 -c \"import socket; s = socket.socket(socket.AF_UNIX); "
               f"s.connect('\\\\0{name}'); print('CONNECTED')\"; "
               f"echo hello > /dev/tcp/127.0.0.1/{listener.tcp_port} && echo tcp-ok")
        res = await shell(client, cmd, workspace, {"network": True})
        assert res.result["isolation"]["network"] == "granted"
        assert "CONNECTED" not in res.result["output"], res.result["output"]
        assert "Operation not permitted" in res.result["output"], res.result["output"]
        assert "tcp-ok" in res.result["output"], res.result["output"]
        host.setblocking(False)
        with pytest.raises(BlockingIOError):
            host.accept()
    finally:
        host.close()


@pytest.fixture
def outside_proc(stack: Stack, tmp_path: Path) -> Iterator[psutil.Process]:
    """A host process running as a uid of the per-call range, as another call's
    process would (the pool will not hand that uid out while it lives), with a
    secret in its environment."""
    procs = Procs(tmp_path / "outside")
    uid = stack.uids[-1]
    proc = procs.spawn(["setpriv", f"--reuid={uid}", f"--regid={stack.info['sandbox_gid']}",
                        "--clear-groups", "--", "sleep", "120"], name="outside",
                       env={"OUTSIDE_SECRET": "outside-" + uuid.uuid4().hex})
    try:
        p = psutil.Process(proc.pid)
        wait_until(lambda: p.name() == "sleep" and p.uids().real == uid,
                   what="the outside process to drop to the sandbox uid")
        yield p
    finally:
        procs.kill_all()


async def test_cannot_signal_or_ptrace_outside(client: BrokerClient, workspace: Path,
                                               outside_proc: psutil.Process) -> None:
    needs_system_python()
    pid = outside_proc.pid
    cmd = (f"kill -STOP {pid}; echo stop=$?; kill -9 {pid}; echo kill=$?; "
           "python3 -c \"import ctypes,sys; libc=ctypes.CDLL(None, use_errno=True); "
           f"r=libc.ptrace(16, {pid}, 0, 0); print('ptrace', r, ctypes.get_errno()); "
           "sys.exit(0 if r != 0 else 9)\"")
    res = await shell(client, cmd, workspace)
    out = res.result["output"]
    assert "stop=1" in out
    assert "kill=1" in out
    assert "ptrace -1" in out
    assert outside_proc.is_running()
    assert outside_proc.status() not in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)


async def test_cannot_read_other_process_environ(client: BrokerClient, workspace: Path,
                                                 outside_proc: psutil.Process) -> None:
    secret = outside_proc.environ()["OUTSIDE_SECRET"]
    res = await shell(client, f"cat /proc/{outside_proc.pid}/environ; "
                      f"tr '\\0' '\\n' < /proc/{outside_proc.pid}/environ", workspace)
    assert res.result["is_error"]
    assert secret not in res.result["output"]
    assert outside_proc.is_running()


async def test_cannot_create_nested_user_namespace(client: BrokerClient,
                                                   workspace: Path) -> None:
    needs_system_python()
    cmd = ("unshare -U -r id; echo unshare=$?; "
           "python3 -c \"import os; os.unshare(os.CLONE_NEWUSER); print('NESTED-OK')\"")
    res = await shell(client, cmd, workspace)
    out = res.result["output"]
    assert "NESTED-OK" not in out
    assert "unshare=0" not in out
    assert "uid=0(" not in out


async def test_double_forked_daemon_does_not_outlive_call(stack: Stack, client: BrokerClient,
                                                          workspace: Path) -> None:
    call_id = f"daemon-{uuid.uuid4().hex[:8]}"
    cmd = ("(setsid sleep 300 >/dev/null 2>&1 < /dev/null &) ; "
           "(nohup sleep 301 >/dev/null 2>&1 &) ; echo spawned")
    res = await shell(client, cmd, workspace, call_id=call_id)
    assert res.result["outcome"] == "ok"
    assert "spawned" in res.result["output"]
    await no_call_processes(stack.uids, call_id, timeout_s=5.0)


async def test_worker_secrets_are_invisible(stack: Stack, client: BrokerClient,
                                            workspace: Path) -> None:
    worker_env = psutil.Process(stack.worker.pid).environ()
    assert worker_env.get("OPENAI_API_KEY") == FAKE_KEY  # the probe is meaningful
    cmd = ("env; cat /proc/self/environ; cat /proc/1/environ; cat /proc/$PPID/environ; "
           "for p in /proc/[0-9]*; do cat $p/environ; done 2>/dev/null; true")
    res = await shell(client, cmd, workspace)
    assert FAKE_KEY not in res.result["output"]
    assert FAKE_KEY.encode() not in res.streamed("stdout")
    assert "OPENAI_API_KEY" not in res.result["output"]


@pytest.mark.timeout(60)
async def test_cancel_kills_everything_and_keeps_partial_output(
        stack: Stack, client: BrokerClient, workspace: Path) -> None:
    call_id = f"cancel-{uuid.uuid4().hex[:8]}"
    body = request_body("shell", {"command": "echo before-sleep; (sleep 600 &); sleep 600"},
                        workspace, call_id=call_id)
    call = client.start("tool", body, budget_s=120)
    got: list[dict[str, object]] = []
    async with asyncio.timeout(20):
        async for chunk in call:
            got.append(unpack(chunk))
            if b"before-sleep" in b"".join(c["data"] for c in got):  # type: ignore[misc]
                break
    assert call_processes(stack.uids, call_id), "the call should be running"
    await call.cancel()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await no_call_processes(stack.uids, call_id, timeout_s=3.0)
    assert loop.time() - t0 <= 3.0
    assert got[0]["stream"] == "stdout"


async def test_worker_keeps_heartbeating_during_long_call(stack: Stack, client: BrokerClient,
                                                          workspace: Path) -> None:
    # A 3 s call against a 1 s liveness window: a blocked loop would lose the worker.
    res = await shell(client, "sleep 3; echo done", workspace)
    assert res.result["outcome"] == "ok"
    assert "done" in res.result["output"]
    assert stack.worker.poll() is None


def test_outside_proc_helper_runs_as_sandbox_uid(stack: Stack,
                                                 outside_proc: psutil.Process) -> None:
    assert outside_proc.uids().real in stack.uids
    assert outside_proc.environ()["OUTSIDE_SECRET"].startswith("outside-")
