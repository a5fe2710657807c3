"""A farm across four hosts (network namespaces joined by veth pairs): a broker
host, a supervisor host and two worker hosts, every link tcp:// + CURVE.

One scenario, in order: sessions spread their tool calls over both worker
hosts; an unknown worker key cannot register; tenant B cannot read tenant A's
session; cutting a worker host's link expires its workers within the liveness
window and the sessions carry on on the other host with the lost calls
reported unknown; healing the link brings the workers back; killing and
restarting the broker recovers everything.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from supervisor.keys import farm_keys, new_key
from tests.helpers import PYTHON, Procs, kill_tree, read_line_with_deadline, wait_until
from tests.multihost.farm import HB_S, LIVENESS, Farm, make_home
from tests.multihost.netns import FARM_ADDR, Hosts

pytestmark = pytest.mark.timeout(180)

TOOL = {"tool_calls": [{"name": "shell", "arguments": {
    "command": "echo $(hostname) >> hosts.txt; sleep 3; echo ok"}}]}
TEXT = {"text": "done", "usage": {"input": 10, "output": 3}}
SCRIPT = {"responses": [TOOL, TEXT, TOOL, TEXT, TOOL, TEXT, TOOL, TEXT]}


def _port(endpoint: str) -> str:
    return endpoint.rsplit(":", 1)[1].rstrip("/")


class Client:
    """Runs ``tests.multihost.sv_client`` on the supervisor host."""

    def __init__(self, procs: Procs, hosts: Hosts, farm: Farm, endpoint: str) -> None:
        self.procs, self.hosts, self.farm, self.endpoint = procs, hosts, farm, endpoint

    def start(self, key: str, *args: str) -> subprocess.Popen[bytes]:
        fk = farm_keys(self.farm.home)
        return self.procs.spawn(
            [*self.hosts.prefix("sup"), PYTHON, "-m", "tests.multihost.sv_client",
             self.endpoint, str(fk.public("supervisor")), str(fk.secret(key)), *args],
            name=f"client-{args[0]}", stdout=subprocess.PIPE)

    def run(self, key: str, *args: str, timeout_s: float = 120.0) -> dict[str, Any]:
        proc = self.start(key, *args)
        try:
            return dict(json.loads(read_line_with_deadline(proc, timeout_s)))
        finally:
            proc.wait(timeout=30)
            if proc.stdout is not None:
                proc.stdout.close()


def _hosts_seen(workspaces: list[Path]) -> list[str]:
    lines: list[str] = []
    for ws in workspaces:
        f = ws / "hosts.txt"
        if f.exists():
            lines += f.read_text().split()
    return lines


def test_farm_across_four_hosts(procs: Procs, hosts: Hosts, tmp_path: Path,
                                workspace_root: Path) -> None:
    home = make_home(tmp_path / "home", workers=("w1", "w2"),
                     clients={"alice": "a", "bob": "b"}, script=SCRIPT)
    new_key("stranger", farm_keys(home).directory)  # a key pair that is NOT allowed
    farm = Farm(home, procs)
    b = farm.broker("tcp://0.0.0.0:0", "tcp://0.0.0.0:0", prefix=hosts.prefix("brk"))
    front_port, back_port = _port(b["frontend"]), _port(b["backend"])
    backend = f"tcp://{FARM_ADDR}:{back_port}"
    url = farm.fakellm("0.0.0.0", prefix=hosts.prefix("brk"))
    route_url = f"http://{FARM_ADDR}:{_port(url)}"
    farm.worker("w1", backend, prefix=hosts.prefix("w1"))
    farm.worker("w2", backend, prefix=hosts.prefix("w2"))
    s = farm.supervisor(f"tcp://{FARM_ADDR}:{front_port}", f"tcp://{hosts.addr('sup')}:0",
                        route_url, prefix=hosts.prefix("sup"))
    client = Client(procs, hosts, farm, s["listen"])

    # 1. Sessions spread their tool calls over both worker hosts.
    workspaces = []
    for i in range(4):
        ws = workspace_root / f"ws{i}"
        ws.mkdir()
        workspaces.append(ws)
    out = client.run("alice", "turns", *map(str, workspaces))
    sids = [r["session"] for r in out["results"]]
    assert [r["end"] for r in out["results"]] == ["turn_complete"] * 4, out
    assert all(r["tool_outcomes"] == ["ok"] for r in out["results"]), out
    status = client.run("alice", "status")
    # (the broker's view goes with a failure: which hosts were registered, expiries)
    assert set(_hosts_seen(workspaces)) == {"w1", "w2"}, (_hosts_seen(workspaces), status)
    assert status["hosts"] == ["w1", "w2"], status
    assert any("host w1" in line for line in status["lines"]), status

    # 2. An unknown worker key cannot register; the farm keeps serving.
    stranger = procs.spawn(
        [*hosts.prefix("w2"), PYTHON, "-m", "supervisor.cli", "worker", "--broker", backend,
         "--server-key", str(farm_keys(home).public("broker")),
         "--key", str(farm_keys(home).secret("stranger")), "--tier-min", "T1",
         "--heartbeat-interval-s", str(HB_S), "--liveness", str(LIVENESS)],
        name="stranger")
    wait_until(lambda: "unknown key (not on the allow-list)" in procs.log(farm.proc["broker"]),
               timeout_s=60, what="the stranger's key refused at the broker")
    assert client.run("alice", "status")["worker_count"] == 2
    kill_tree(stranger.pid)
    stranger.wait(timeout=10)

    # 3. Tenant B cannot read tenant A's session.
    assert client.run("bob", "read", sids[0])["kinds"] == ["unknown_session"] * 2

    # 4. Partition: cut w1 while tool calls run there; its workers expire, the
    # sessions continue on w2, the lost calls are reported unknown.
    before = _hosts_seen(workspaces).count("w1")
    turns = client.start("alice", "turn", *sids)
    wait_until(lambda: _hosts_seen(workspaces).count("w1") > before, timeout_s=60,
               what="a tool call running on w1")
    hosts.link("w1", up=False)
    cut_at = time.monotonic()
    wait_until(lambda: client.run("alice", "status")["hosts"] == ["w2"], timeout_s=30,
               interval_s=0.05, what="w1's worker expired")
    expired_after_s = time.monotonic() - cut_at
    print(f"w1's worker gone from STATUS {expired_after_s:.2f}s after the cut (upper bound: "
          "includes starting a status client process per probe)")
    result = json.loads(read_line_with_deadline(turns, 120))
    turns.wait(timeout=30)
    ends = [r["end"] for r in result["results"]]
    outcomes = [o for r in result["results"] for o in r["tool_outcomes"]]
    assert ends == ["turn_complete"] * 4, result
    assert "unknown" in outcomes, result
    # Liveness window 1 s; each status probe is a process start on a loaded machine.
    assert expired_after_s < 1.0 + 15.0, expired_after_s

    # 5. Heal: w1's worker reconnects and registers again.
    hosts.link("w1", up=True)
    wait_until(lambda: client.run("alice", "status")["hosts"] == ["w1", "w2"], timeout_s=60,
               interval_s=0.05, what="w1 back in service")

    # 6. Kill and restart the broker on the same ports: everything recovers.
    kill_tree(farm.proc["broker"].pid)
    farm.proc["broker"].wait(timeout=10)
    farm.broker(f"tcp://0.0.0.0:{front_port}", f"tcp://0.0.0.0:{back_port}",
                prefix=hosts.prefix("brk"), name="broker2")
    wait_until(lambda: client.run("alice", "status")["hosts"] == ["w1", "w2"], timeout_s=60,
               interval_s=0.05, what="both worker hosts re-registered")
    again = client.run("alice", "turn", sids[0], sids[1])
    assert [r["end"] for r in again["results"]] == ["turn_complete"] * 2, again
    assert all(r["tool_outcomes"] == ["ok"] for r in again["results"]), again
