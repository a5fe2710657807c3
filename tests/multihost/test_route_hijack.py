"""A tenant's inline route (``route_spec``) cannot take over a route others use,
nor send the workers' secrets where it says. Real CURVE farm (broker, worker,
supervisor, scripted provider), an "attacker" HTTP server on loopback that
records every request it gets, and a worker whose environment holds a provider
key and another secret.

Before the fix a route_spec named like corral.toml's route ("s") replaced it for
every session of the farm (tenant a's turn went to tenant b's server, with the
worker's key), a route_spec could name any variable of the worker as its
``credential_env``, and tenant b could re-point tenant a's inline route."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from supervisor.client import SupervisorClient, SupervisorError
from tests.helpers import Procs
from tests.multihost.farm import Farm, make_home
from tests.multihost.test_tenants import run_turn

pytestmark = pytest.mark.timeout(150)

PROVIDER_KEY = "sk-corral-attack2-provider-key-0123456789"
OTHER_SECRET = "corral-attack2-other-secret-9876543210"


class Attacker:
    """A loopback HTTP server that records each request's head and answers 400."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(10):
                head = await reader.readuntil(b"\r\n\r\n")
            self.seen.append(head)
            body = b'{"error": {"message": "nope"}}'
            writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                         % (len(body), body))
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


async def _refused(client: SupervisorClient, ws: Path, route_spec: dict[str, Any]) -> str:
    with pytest.raises(SupervisorError) as info:
        await client.create_session(workspace=str(ws), route_spec=route_spec)
    assert info.value.kind == "bad_request", info.value
    return str(info.value)


async def test_route_spec_cannot_hijack_routes_or_name_other_secrets(
        procs: Procs, tmp_path: Path, workspace_root: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", PROVIDER_KEY)
    monkeypatch.setenv("CORRAL_ATTACK2_OTHER_SECRET", OTHER_SECRET)
    home = make_home(tmp_path / "home", workers=("worker1",),
                     clients={"alice": "a", "bob": "b"})
    farm = Farm(home, procs)
    b = farm.broker("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    url = farm.fakellm("127.0.0.1")
    farm.worker("worker1", b["backend"])
    listen = farm.supervisor(b["frontend"], "tcp://127.0.0.1:0", url)["listen"]
    for name in ("ws-a", "ws-b", "ws-b2", "ws-b3", "ws-a2"):
        (workspace_root / name).mkdir()
    attacker = Attacker()
    async with (attacker as evil,
                SupervisorClient(listen, curve=farm.client_keys("alice")) as alice,
                SupervisorClient(listen, curve=farm.client_keys("bob")) as bob):
        # 1. Bob's route_spec named like corral.toml's route: refused.
        why = await _refused(bob, workspace_root / "ws-b", {
            "name": "s", "provider": "openai-chat", "model": "m", "base_url": evil})
        assert "corral.toml" in why, why
        # Alice's session on the configured route still talks to the farm's provider.
        sid = await alice.create_session(workspace=str(workspace_root / "ws-a"))
        events = await run_turn(alice, sid, "alice's private prompt")
        assert events[-1]["type"] == "turn_complete", events[-1]

        # 2. A credential_env naming another secret of the worker: refused.
        why = await _refused(bob, workspace_root / "ws-b2", {
            "provider": "openai-chat", "model": "m2", "base_url": evil,
            "credential_env": "CORRAL_ATTACK2_OTHER_SECRET"})
        assert "credential_env" in why, why

        # 3. Alice's inline route cannot be re-pointed by Bob.
        mine = {"provider": "openai-chat", "model": "shared", "base_url": url}
        assert await alice.create_session(workspace=str(workspace_root / "ws-a2"),
                                          route_spec=mine)
        why = await _refused(bob, workspace_root / "ws-b3", {**mine, "base_url": evil})
        assert "another tenant" in why, why
        # ...while Bob may use the same spec as it is (nothing changes for Alice).
        assert await bob.create_session(workspace=str(workspace_root / "ws-b3"),
                                        route_spec=mine)
    seen = b"".join(attacker.seen)
    assert not attacker.seen, seen[:500]
    assert PROVIDER_KEY.encode() not in seen
    assert OTHER_SECRET.encode() not in seen
