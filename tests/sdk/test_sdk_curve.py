"""The SDK over tcp:// with CURVE keys (docs/multihost.md): a tenant's program
holds its client tools and runs them; another tenant's key can neither hold
them nor reach the session. Real broker, worker, supervisor, scripted provider."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.sdk import (
    Corral,
    SessionOptions,
    SupervisorError,
    ToolCallEnd,
    TurnComplete,
    tool,
)
from tests.helpers import Procs
from tests.multihost.farm import Farm, make_home
from tests.sdk.farms import PROBE_SCRIPT

pytestmark = pytest.mark.timeout(150)


async def test_client_tools_over_curve_belong_to_their_tenant(
        procs: Procs, tmp_path: Path, workspace_root: Path) -> None:
    home = make_home(tmp_path / "home", workers=("worker1",),
                     clients={"alice": "a", "bob": "b"}, script=PROBE_SCRIPT)
    farm = Farm(home, procs)
    b = farm.broker("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    url = farm.fakellm("127.0.0.1")
    farm.worker("worker1", b["backend"])
    listen = farm.supervisor(b["frontend"], "tcp://127.0.0.1:0", url)["listen"]

    @tool
    def probe(x: int) -> str:
        return f"alice's {x}"

    async with Corral(listen, curve=farm.client_keys("alice")) as alice, \
            Corral(listen, curve=farm.client_keys("bob")) as bob:
        session = await alice.create_session(SessionOptions(workspace=workspace_root),
                                             tools=[probe])
        with pytest.raises(SupervisorError) as refused:
            await bob.client.call("register_client", session_id=session.id,
                                  tools=["probe"], hooks=True)
        assert refused.value.kind == "unknown_session"
        with pytest.raises(SupervisorError) as refused:
            await bob.resume(session.id, tools=[probe])
        assert refused.value.kind == "unknown_session"
        events = [e async for e in session.run("go", timeout_s=60)]
    end = next(e for e in events if isinstance(e, ToolCallEnd))
    assert (end.state, end.output, end.tier) == ("ok", "alice's 1", "client")
    assert isinstance(events[-1], TurnComplete)
