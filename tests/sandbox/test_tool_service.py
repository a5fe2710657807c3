"""The ``tool`` service end to end (real broker, worker, sandbox): the five
tools, argument errors, streaming, isolation records, policies and a
user-owned workspace."""

from __future__ import annotations

import asyncio
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from broker.client import BrokerClient
from broker.errors import RequestFailed
from broker.protocol import pack, unpack
from tests.sandbox.conftest import (
    Stack,
    call_processes,
    call_tool,
    host_read,
    no_call_processes,
    request_body,
    shell,
)

pytestmark = pytest.mark.sandbox
OWNER = 4242


async def test_file_tools_roundtrip(client: BrokerClient, workspace: Path) -> None:
    r = await call_tool(client, "write_file", {"path": "src/a.txt",
                                               "content": "one\ntwo\ntwo\nthree\n"}, workspace)
    assert r.result["outcome"] == "ok", r.result["output"]
    assert host_read(workspace / "src" / "a.txt") == "one\ntwo\ntwo\nthree\n"
    r = await call_tool(client, "read_file", {"path": "src/a.txt", "offset": 1, "limit": 2},
                        workspace)
    assert r.result["output"].startswith("two\ntwo\n")
    assert r.result["truncated"]
    r = await call_tool(client, "edit_file", {"path": "src/a.txt", "old": "two", "new": "2"},
                        workspace)
    assert r.result["error_kind"] == "old_ambiguous"
    r = await call_tool(client, "edit_file", {"path": "src/a.txt", "old": "four", "new": "4"},
                        workspace)
    assert r.result["error_kind"] == "old_not_found"
    r = await call_tool(client, "edit_file", {"path": "src/a.txt", "old": "two", "new": "2",
                                              "count": 2}, workspace)
    assert r.result["outcome"] == "ok"
    assert host_read(workspace / "src" / "a.txt") == "one\n2\n2\nthree\n"
    r = await call_tool(client, "list_dir", {"path": "src"}, workspace)
    assert "a.txt" in r.result["output"]
    r = await call_tool(client, "read_file", {"path": "missing"}, workspace)
    assert r.result["error_kind"] == "not_found"
    iso = r.result["isolation"]
    assert iso["filesystem"] == "workspace-openat2"
    assert iso["uid"] != 0


async def test_file_and_shell_files_are_consistent(stack: Stack, client: BrokerClient,
                                                   workspace: Path) -> None:
    await call_tool(client, "write_file", {"path": "by_tool", "content": "t"}, workspace)
    await shell(client, "echo s > by_shell", workspace)
    # Both end owned by the workspace's owner (root here), whoever created them.
    assert os.stat(workspace / "by_tool").st_uid == os.stat(workspace).st_uid
    assert os.stat(workspace / "by_shell").st_uid == os.stat(workspace).st_uid
    r = await shell(client, "cat by_tool; echo more >> by_tool", workspace)
    assert r.result["outcome"] == "ok"
    r = await call_tool(client, "edit_file", {"path": "by_shell", "old": "s", "new": "S"},
                        workspace)
    assert r.result["outcome"] == "ok"


@pytest.mark.parametrize("args", [{}, {"command": 7}, {"command": "ls", "bogus": 1},
                                  {"command": "ls", "timeout_s": "soon"}])
async def test_bad_arguments_are_readable_errors(client: BrokerClient, workspace: Path,
                                                 args: dict[str, object]) -> None:
    r = await call_tool(client, "shell", args, workspace)
    assert r.result["is_error"]
    assert r.result["error_kind"] == "bad_arguments"
    assert "shell" in r.result["output"]
    assert "Traceback" not in r.result["output"]


async def test_unknown_tool_and_bad_workspace(client: BrokerClient, workspace: Path) -> None:
    r = await call_tool(client, "format_disk", {}, workspace)
    assert r.result["error_kind"] == "unknown_tool"
    r = await call_tool(client, "list_dir", {}, Path("/etc"))
    assert r.result["error_kind"] == "workspace_unusable"
    assert "system directory" in r.result["output"]
    r = await call_tool(client, "list_dir", {}, Path("/tmp"))
    assert r.result["error_kind"] == "workspace_unusable"
    r = await call_tool(client, "list_dir", {}, workspace / "missing")
    assert r.result["error_kind"] == "workspace_unusable"


async def test_malformed_request_is_a_bad_request_failure(client: BrokerClient,
                                                          workspace: Path) -> None:
    with pytest.raises(RequestFailed) as info:
        await client.request("tool", pack({"tool": "shell"}), budget_s=10)
    assert info.value.failure.kind == "bad_request"
    assert not info.value.failure.retryable
    # every envelope fault through the one decoder (sandbox_worker.api): a typed
    # bad_request naming the field, and the worker stays up for the next call
    good = unpack(request_body("shell", {"command": "true"}, workspace))
    for body, names in [(b"\xc1", "not msgpack"), (pack([1]), "must be a map"),
                        (pack({**good, "call_id": 5}), "'call_id'"),
                        (pack({k: v for k, v in good.items() if k != "arguments"}),
                         "'arguments'"),
                        (pack({**good, "workspace_identity": [1, -1]}),
                         "'workspace_identity'")]:
        with pytest.raises(RequestFailed) as info:
            await client.request("tool", body, budget_s=10)
        assert (info.value.failure.kind, info.value.failure.retryable) == ("bad_request", False)
        assert names in info.value.failure.message, info.value.failure
    r = await call_tool(client, "shell", {"command": "echo up"}, workspace)
    assert r.result["outcome"] == "ok", r.result["output"]


async def test_output_streams_apart_while_running(client: BrokerClient,
                                                  workspace: Path) -> None:
    call = client.start("tool", request_body(
        "shell", {"command": "echo out; echo err >&2; sleep 1.5; echo late"}, workspace),
        budget_s=30)
    first_seen_while_running = None
    chunks = []
    async for body in call:
        if first_seen_while_running is None:
            first_seen_while_running = not call.done
        chunks.append(unpack(body))
    result = unpack(await call.result())
    assert first_seen_while_running
    out = b"".join(c["data"] for c in chunks if c["stream"] == "stdout")
    err = b"".join(c["data"] for c in chunks if c["stream"] == "stderr")
    assert out == b"out\nlate\n"
    assert err == b"err\n"
    assert result["stdout_bytes"] == len(out)
    assert result["stderr_bytes"] == len(err)
    assert "[stderr]\nerr" in result["output"]


async def test_isolation_record_is_complete(stack: Stack, client: BrokerClient,
                                            workspace: Path) -> None:
    r = await shell(client, "echo hi", workspace, {"limits": {"cpu_s": 7, "open_files": 99}})
    iso = r.result["isolation"]
    assert set(iso) == {"tier", "filesystem", "network", "pid_namespace", "seccomp", "uid",
                        "limits", "degraded", "unsandboxed_opt_in", "kernel", "sandbox_mode",
                        "git_writable"}
    assert iso["sandbox_mode"] == "workspace-write"
    assert iso["git_writable"] is (stack.tier != "T2")  # T1 cannot bind .git read-only
    assert iso["tier"] == stack.tier
    assert iso["uid"] in stack.uids
    assert iso["uid"] != 0
    assert iso["seccomp"] is True
    assert iso["network"] == "none"
    assert iso["limits"]["cpu_s"] == 7
    assert iso["limits"]["open_files"] == 99
    assert iso["unsandboxed_opt_in"] is False
    if stack.tier == "T2":
        assert iso["pid_namespace"] is True
        assert iso["degraded"] == [] or all("cgroup" in d for d in iso["degraded"])
    else:
        assert iso["pid_namespace"] is False
        assert any("pid namespace" in d for d in iso["degraded"])
    policy = {"limits": {"cpu_s": 7, "open_files": 99}}
    limits = await shell(client, "ulimit -t; ulimit -n; ulimit -u", workspace, policy)
    assert limits.result["output"].split()[:3] == ["7", "99", "256"]


async def test_policy_tier_min_refuses_with_fix(stack: Stack, client: BrokerClient,
                                                workspace: Path) -> None:
    r = await shell(client, "echo hi", workspace, {"tier_min": "T2"})
    if stack.tier == "T2":
        assert r.result["outcome"] == "ok"
    else:
        assert r.result["error_kind"] == "tier_below_minimum"
        assert "bubblewrap" in r.result["output"]


async def test_workdir(stack: Stack, client: BrokerClient, workspace: Path) -> None:
    (workspace / "sub").mkdir()
    r = await call_tool(client, "shell", {"command": "pwd", "workdir": "sub"}, workspace)
    # T2 binds the workspace at a neutral path; T1 has no mount namespace.
    inside = "/workspace" if stack.tier == "T2" else str(workspace)
    assert r.result["output"].strip() == f"{inside}/sub"
    r = await call_tool(client, "shell", {"command": "pwd", "workdir": "../"}, workspace)
    assert r.result["error_kind"] == "outside_workspace"


async def test_user_owned_workspace_just_works(stack: Stack, client: BrokerClient,
                                               workspace: Path) -> None:
    (workspace / "notes.txt").write_text("from the user\n")
    os.chown(workspace / "notes.txt", OWNER, OWNER)
    os.chmod(workspace / "notes.txt", 0o644)
    os.chown(workspace, OWNER, OWNER)
    os.chmod(workspace, 0o755)
    r = await shell(client, "cat notes.txt && echo from the tool >> notes.txt && "
                    "echo new > made_by_shell", workspace)
    assert r.result["outcome"] == "ok", r.result["output"]
    r = await call_tool(client, "edit_file", {"path": "notes.txt", "old": "user",
                                              "new": "owner"}, workspace)
    assert r.result["outcome"] == "ok", r.result["output"]
    r = await call_tool(client, "write_file", {"path": "made_by_tool", "content": "x"},
                        workspace)
    assert r.result["outcome"] == "ok"
    assert host_read(workspace / "notes.txt") == "from the owner\nfrom the tool\n"
    # The owner (not root) can use and change what the tools created.
    as_owner = ["setpriv", f"--reuid={OWNER}", f"--regid={OWNER}", "--clear-groups", "--",
                "sh", "-c", "cat made_by_shell made_by_tool && echo owner >> made_by_tool && "
                "rm made_by_shell"]
    done = await asyncio.to_thread(subprocess.run, as_owner, cwd=workspace,
                                   capture_output=True, text=True, timeout=20, check=False)
    assert done.returncode == 0, done.stderr
    assert host_read(workspace / "made_by_tool") == "xowner\n"
    # The owner's own bits are untouched.
    assert os.stat(workspace).st_uid == OWNER
    assert os.stat(workspace / "notes.txt").st_mode & 0o700 == 0o600


def test_worker_reports_its_tier(stack: Stack) -> None:
    info = stack.info
    assert info["tier"] == stack.tier
    assert stack.tier in info["working_tiers"]
    assert info["sandbox_uid"] != 0
    assert info["tools"] == ["shell", "read_file", "write_file", "edit_file", "list_dir"]


async def test_partials_are_coalesced(client: BrokerClient, workspace: Path) -> None:
    # 2000 separate small writes over about a second arrive as few chunks.
    cmd = "for i in $(seq 2000); do echo line$i; [ $((i % 200)) = 0 ] && sleep 0.1; done"
    res = await shell(client, cmd, workspace)
    assert res.result["outcome"] == "ok"
    out = res.streamed("stdout")
    assert out.count(b"\n") == 2000
    assert len(res.chunks) < 200


async def test_call_runs_in_the_worker_cgroup(stack: Stack, client: BrokerClient,
                                              workspace: Path) -> None:
    if not stack.info["cgroup"]["applied"]:
        pytest.skip(f"worker cgroup not available here: {stack.info['cgroup']['reason']}")
    call_id = f"cgroup-{uuid.uuid4().hex[:8]}"
    call = client.start("tool", request_body("shell", {"command": "echo up; sleep 30"},
                                             workspace, call_id=call_id), budget_s=60)
    async with asyncio.timeout(20):
        async for _chunk in call:
            break
    procs = call_processes(stack.uids, call_id)
    assert procs
    group = f"corral/worker-{stack.worker.pid}"
    for p in procs:
        lines = host_read(f"/proc/{p.pid}/cgroup").splitlines()
        controllers = {ln.split(":")[1]: ln.split(":")[2] for ln in lines}
        if stack.info["cgroup"]["version"] == "v1":
            assert controllers["memory"].endswith(group)
            assert controllers["pids"].endswith(group)
        else:
            assert controllers[""].endswith(group)
    await call.cancel()
    await no_call_processes(stack.uids, call_id)
