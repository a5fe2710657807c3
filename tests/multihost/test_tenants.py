"""Tenants over CURVE: a client key bound to tenant A drives its own sessions and
cannot list, read, subscribe to or drive tenant B's; a key off the allow-list
cannot reach the supervisor at all. One host, every endpoint tcp:// + CURVE."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from broker.security import CurveClient
from supervisor import wire
from supervisor.client import SupervisorClient, SupervisorError, SupervisorUnavailable
from tests.helpers import Procs
from tests.multihost.farm import Farm, make_home

pytestmark = pytest.mark.timeout(150)


async def run_turn(sv: SupervisorClient, sid: str, text: str) -> list[dict[str, Any]]:
    sub = await sv.submit(sid, {"type": "user_input", "text": text})
    seen: list[dict[str, Any]] = []
    async with asyncio.timeout(60):
        async for e in sv.events(sid):
            seen.append(e)
            if e.get("submission_id") == sub and e["type"] in ("turn_complete", "turn_aborted"):
                return seen
    raise AssertionError("event stream ended")


async def _raw_hello(endpoint: str, curve: CurveClient, identity: bytes) -> str:
    """One ``hello`` from a DEALER with a chosen routing identity; the answer's tenant."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, identity)
        curve.apply(sock)
        sock.connect(endpoint)
        sock.send_multipart(wire.encode({"id": 1, "call": "hello", "args": {}}))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if await asyncio.to_thread(sock.poll, 200):
                msg = wire.decode(sock.recv_multipart())
                if msg.get("id") == 1:
                    return str(msg["result"]["tenant"])
        raise AssertionError("no answer to hello")
    finally:
        sock.close()


async def drain(sv: SupervisorClient, sid: str) -> None:
    async with asyncio.timeout(10):
        async for _ in sv.events(sid):
            pass


async def test_tenant_isolation_over_curve(procs: Procs, tmp_path: Path,
                                           workspace_root: Path) -> None:
    home = make_home(tmp_path / "home", workers=("worker1",),
                     clients={"alice": "a", "bob": "b", "admin": None})
    farm = Farm(home, procs)
    b = farm.broker("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    url = farm.fakellm("127.0.0.1")
    farm.worker("worker1", b["backend"])
    s = farm.supervisor(b["frontend"], "tcp://127.0.0.1:0", url)
    listen = s["listen"]
    assert listen.startswith("tcp://")
    ws = workspace_root / "ws-a"
    ws.mkdir()
    async with (SupervisorClient(listen, curve=farm.client_keys("alice")) as alice,
                SupervisorClient(listen, curve=farm.client_keys("bob")) as bob):
        assert (await alice.call("hello"))["tenant"] == "a"
        assert (await bob.call("hello"))["tenant"] == "b"
        sid = await alice.create_session(workspace=str(ws))
        events = await run_turn(alice, sid, "note the host")
        assert events[-1]["type"] == "turn_complete", events[-1]
        tool_end = next(e for e in events if e["type"] == "tool_call_end")
        assert tool_end["payload"]["outcome"] == "ok", tool_end
        assert (ws / "hosts.txt").exists()

        listed = await bob.call("list_sessions")
        assert sid not in [x["session_id"] for x in listed["sessions"]]
        assert sid in [x["session_id"] for x in (await alice.call("list_sessions"))["sessions"]]
        for call, args in (("describe", {}), ("history", {}),
                           ("submit", {"op": {"type": "user_input", "text": "steal"}})):
            with pytest.raises(SupervisorError) as info:
                await bob.call(call, session_id=sid, **args)
            assert info.value.kind == "unknown_session", (call, info.value)
        with pytest.raises(SupervisorError):
            await drain(bob, sid)
        # Tenants never share a workspace, not even through a symlink.
        (workspace_root / "link").symlink_to(ws)
        for taken in (ws, ws / "sub", workspace_root / "link"):
            with pytest.raises(SupervisorError) as refused:
                await bob.create_session(workspace=str(taken))
            assert refused.value.kind == "bad_request", refused.value
        (workspace_root / "ws-b").mkdir()
        assert await bob.create_session(workspace=str(workspace_root / "ws-b"))
        history = await alice.history(sid)
        assert not any("steal" in str(e.get("payload")) for e in history["events"])
    log = procs.log(farm.proc["supervisor"])
    assert "refused: tenant 'b' tried to reach session" in log

    # A client without a tenant (admin) sees no tenant's sessions either.
    async with SupervisorClient(listen, curve=farm.client_keys("admin")) as admin:
        assert sid not in [x["session_id"] for x in (await admin.call("list_sessions"))[
            "sessions"]]
    # The tenant belongs to the connection's key, not to the routing identity: a
    # connection of tenant b that takes over tenant a's identity is tenant b.
    assert [await _raw_hello(listen, farm.client_keys(k), b"same-id!") for k in
            ("alice", "bob")] == ["a", "b"]
    assert "reused by tenant 'b' (was 'a')" in procs.log(farm.proc["supervisor"])

    # A key that is not on the allow-list never gets an answer.
    from broker.security import write_key_pair

    write_key_pair(tmp_path, "mallory")
    mallory = CurveClient.from_files(farm.keys_dir / "supervisor.key",
                                     tmp_path / "mallory.key_secret")
    with pytest.raises(SupervisorUnavailable):
        async with SupervisorClient(listen, curve=mallory, timeout_s=2.0) as m:
            await m.call("list_sessions", timeout_s=2.0)
    assert "unknown key (not on the allow-list)" in procs.log(farm.proc["supervisor"])
