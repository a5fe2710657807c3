"""Outside-tool figures for ``scripts/bench tools`` (``tools_bench.py`` runs
these after its own, on a broker and one tool worker of its ``Stack``):

- ``mcp_cold_start_s``: the first call of a session to ``mcp-server-time``
  through Corral: the server started in the sandbox, initialized, listed,
  called;
- ``mcp_call_vs_direct``: warm calls of the same tool through Corral (the
  broker, the worker, the sandboxed server, pinned to its worker) against a
  direct ``mcp`` client (the SDK's own ``stdio_client``) calling the same
  server unsandboxed from this process; interleaved, medians (target <= 2.0);
- ``command_tool_vs_shell``: a command tool running ``true`` (its arguments on
  stdin) against a ``shell`` call of ``["true"]``, interleaved (target <= 1.2).

The supervisor's schema check (``supervisor/tools/schema.py``, microseconds)
is not in the Corral figures: this module may not import the supervisor; the
requests are the ones the supervisor's router sends.

The server's Python packages must be readable in the sandbox, which binds
/usr, /etc and /opt only: ``sandbox_site`` hard-links this interpreter's
site-packages under /opt/corral-bench-site once (nothing is copied or fetched).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from broker.client import BrokerClient
from broker.protocol import pack, unpack

SITE_ROOT = Path("/opt/corral-bench-site")
PYTHON_IN_SANDBOX = "/usr/bin/python3"


def sandbox_site() -> str:
    src = Path(next(p for p in sys.path if p.endswith("site-packages")
                    and (Path(p) / "mcp_server_time").is_dir()))
    key = hashlib.sha256("\n".join(sorted(os.listdir(src))).encode()).hexdigest()[:16]
    dst = SITE_ROOT / key
    if not dst.exists():
        SITE_ROOT.mkdir(mode=0o755, exist_ok=True)
        tmp = SITE_ROOT / f".{key}.{os.getpid()}"
        if subprocess.run(["cp", "-al", str(src), str(tmp)]).returncode != 0:
            # /opt on another filesystem: hard links cannot cross it; copy.
            shutil.rmtree(tmp, ignore_errors=True)
            subprocess.run(["cp", "-a", str(src), str(tmp)], check=True)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, dst)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(dst)


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000.0


async def _send(client: BrokerClient, service: str, body: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = unpack(await client.start(service, pack(body), budget_s=60)
                                    .result())
    if result.get("is_error"):
        raise RuntimeError(f"bench call failed: {result['output']}")
    return result


async def bench_mcp(frontend: str, workspace: str, n: int) -> dict[str, float]:
    from mcp.client.session import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    site = sandbox_site()
    spec = {"command": [PYTHON_IN_SANDBOX, "-m", "mcp_server_time", "--local-timezone", "UTC"],
            "env": {"PYTHONPATH": site, "PYTHONDONTWRITEBYTECODE": "1"}, "network": False}
    args = {"timezone": "UTC"}

    def body(i: int) -> dict[str, Any]:
        return {"call_id": f"mcp-{i}", "tool": "mcp__time__get_current_time",
                "arguments": args, "session_id": "bench-mcp", "workspace": workspace,
                "mcp": {"server": "time", "spec": spec, "op": "call",
                        "tool": "get_current_time"}}

    corral: list[float] = []
    direct: list[float] = []
    params = StdioServerParameters(command=PYTHON_IN_SANDBOX,
                                   args=["-m", "mcp_server_time", "--local-timezone", "UTC"],
                                   env={"PYTHONPATH": site, "PYTHONDONTWRITEBYTECODE": "1"})
    async with BrokerClient(frontend) as client:
        t = time.perf_counter()
        first = await _send(client, "tool", body(0))
        cold_s = time.perf_counter() - t
        pin = str(first["pin"])
        with open(os.devnull, "w") as devnull:  # noqa: ASYNC230 -- /dev/null never blocks
            async with stdio_client(params, errlog=devnull) as (read, write), \
                    ClientSession(read, write) as session:
                await session.initialize()
                for i in range(n + 3):
                    t = time.perf_counter()
                    await _send(client, pin, body(i + 1))
                    c = time.perf_counter() - t
                    t = time.perf_counter()
                    answer = await session.call_tool("get_current_time", args)
                    d = time.perf_counter() - t
                    if answer.is_error:
                        raise RuntimeError("direct call failed")
                    if i >= 3:
                        corral.append(c)
                        direct.append(d)
    return {"mcp_cold_start_s": round(cold_s, 3),
            "mcp_corral_call_p50_ms": round(_median_ms(corral), 3),
            "mcp_direct_call_p50_ms": round(_median_ms(direct), 3),
            "mcp_call_vs_direct": round(_median_ms(corral) / _median_ms(direct), 3)}


async def bench_command_tool(frontend: str, workspace: str, n: int) -> dict[str, float]:
    tool = {"description": "true", "parameters": {"type": "object"}, "command": ["true"],
            "idempotent": False, "read_only": False}
    command: list[float] = []
    shell: list[float] = []
    async with BrokerClient(frontend) as client:
        for i in range(n + 3):
            t = time.perf_counter()
            await _send(client, "tool", {"call_id": f"ct-{i}", "tool": "t",
                                         "arguments": {"x": i}, "session_id": "bench-ct",
                                         "workspace": workspace, "command_tool": tool})
            c = time.perf_counter() - t
            t = time.perf_counter()
            await _send(client, "tool", {"call_id": f"sh-{i}", "tool": "shell",
                                         "arguments": {"command": ["true"]},
                                         "session_id": "bench-ct", "workspace": workspace})
            s = time.perf_counter() - t
            if i >= 3:
                command.append(c)
                shell.append(s)
    return {"command_tool_true_p50_ms": round(_median_ms(command), 3),
            "command_tool_vs_shell": round(_median_ms(command) / _median_ms(shell), 3)}
