"""A new user's first hour (issue 16), each item through the real ``corral`` CLI:
a first run that works on an empty home, a temporary farm others can reach,
sessions with real states, terminate/delete, ``--workers 0``, and honest
one-line errors at the edges (no traceback, nothing lost).

Real farms, real sandbox, the scripted provider; every process is killed by
pid afterwards (the ``homes`` fixture of test_cli_e2e and ``procs``).
"""

from __future__ import annotations

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

from tests.cli.test_cli_basics import help_text
from tests.cli.test_cli_e2e import (
    _up,
    alive,
    events_of,
    make_home,
    make_ws,
    processes_naming,
    shell,
    spawn,
    text,
)
from tests.helpers import PYTHON, REPO, Procs, read_line_with_deadline, wait_until

pytestmark = pytest.mark.timeout(180)

NO_KEYS = {k: v for k, v in os.environ.items()
           if k not in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "CORRAL_API_KEY")}


def cli(home: Path | None, *args: str, env: dict[str, str] | None = None,
        timeout_s: float = 120, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    argv = [PYTHON, "-m", "supervisor.cli", *args]
    if home is not None:
        argv += ["--home", str(home)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=cwd,
                          stdin=subprocess.DEVNULL, env=env or NO_KEYS)


def one_line_error(r: subprocess.CompletedProcess[str]) -> str:
    """The error a user sees: no traceback, and the lines starting with ``corral:``."""
    assert "Traceback" not in r.stderr, r.stderr
    assert "Traceback" not in r.stdout, r.stdout
    return r.stderr


def sessions(home: Path, *args: str) -> list[dict[str, Any]]:
    r = cli(home, "sessions", "--json", *args)
    assert r.returncode == 0, r.stderr
    listed: list[dict[str, Any]] = json.loads(r.stdout)["sessions"]
    return listed


# -- a first run that works ------------------------------------------------------


def test_init_writes_a_commented_config_with_a_working_route(tmp_path: Path) -> None:
    demo = cli(tmp_path / "a", "init")
    assert demo.returncode == 0, demo.stderr
    toml = (tmp_path / "a" / "corral.toml").read_text()
    assert 'script = "demo-script.json"' in toml
    assert toml.count("\n#") > 20
    assert json.loads((tmp_path / "a" / "demo-script.json").read_text())["responses"]
    assert "scripted demo" in demo.stdout

    keyed = cli(tmp_path / "b", "init", "--json", env={**NO_KEYS, "OPENAI_API_KEY": "sk-x"})
    assert json.loads(keyed.stdout)["written"] is True
    toml = (tmp_path / "b" / "corral.toml").read_text()
    assert 'provider = "openai-responses"' in toml
    assert 'credential_env = "OPENAI_API_KEY"' in toml
    assert "sk-x" not in toml  # never the key itself

    again = cli(tmp_path / "b", "init", "--json")
    assert json.loads(again.stdout)["written"] is False
    assert (tmp_path / "b" / "corral.toml").read_text() == toml


def test_the_first_run_on_an_empty_home_works(homes: list[Path],
                                               workspace_root: Path) -> None:
    home = workspace_root / "fresh-home"
    homes.append(home)
    ws = make_ws(workspace_root, "proj")
    (ws / "hello.txt").write_text("hi\n")
    r = cli(None, "run", "--workspace", str(ws), "list the files",
            env={**NO_KEYS, "CORRAL_HOME": str(home)})
    assert r.returncode == 0, r.stderr
    assert "▶ list_dir" in r.stdout
    assert "hello.txt" in r.stdout
    assert "turn complete" in r.stdout
    assert f"wrote {home / 'corral.toml'}" in r.stderr
    assert not (home / "farm.json").exists()  # the temporary farm is gone


def test_version_help_and_completion() -> None:
    version = cli(None, "--version")
    assert version.returncode == 0
    assert re.fullmatch(r"corral \d+\.\d+\.\d+\n", version.stdout)
    top = cli(None, "--help").stdout
    commands = re.findall(r"^    (\S+)\s+(\S.*)$", top, flags=re.M)
    assert {"init", "sessions", "terminate", "delete", "completion"} <= dict(commands).keys()
    for command, summary in commands:
        assert summary.strip(), command
        own = help_text(command)
        description = own.split("\n\n")[1]
        assert not description.startswith(("options:", "positional")), (command, own)

    script = cli(None, "completion", "bash").stdout

    def complete(line: str) -> list[str]:
        words = line.split(" ")
        probe = (f"{script}\nCOMP_WORDS=({' '.join(repr(w) for w in words)}); "
                 f"COMP_CWORD={len(words) - 1}; _corral_complete; "
                 "printf '%s\\n' \"${COMPREPLY[@]}\"")
        out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True,
                             timeout=30)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    assert complete("corral ses") == ["sessions"]
    assert "--approval" in complete("corral run --appr")
    assert complete("corral run --approval ") == ["ask", "allow", "deny"]
    assert complete("corral sessions --state w") == ["waiting_for_approval"]
    assert complete("corral completion ") == ["bash", "zsh"]
    zsh = cli(None, "completion", "zsh").stdout
    assert zsh.startswith("autoload -U +X bashcompinit && bashcompinit\n")
    assert subprocess.run(["bash", "-n", "-c", script], timeout=30).returncode == 0


# -- the temporary farm, approvals without a terminal, sessions on a stopped farm ------


def test_a_temporary_farm_is_reachable_while_it_lives(homes: list[Path], workspace_root: Path,
                                                      procs: Procs) -> None:
    home = make_home(workspace_root, "home", [shell("sleep 60"), text("never")])
    homes.append(home)
    ws = make_ws(workspace_root)
    run = spawn(procs, home, "run", "--workspace", str(ws), "--json", "go",
                stdout=subprocess.PIPE)
    seen: list[dict[str, Any]] = []
    while not any(e["type"] == "tool_call_begin" for e in seen):
        seen.append(json.loads(read_line_with_deadline(run, 90)))
    sid = seen[0]["session_id"]
    farm = json.loads((home / "farm.json").read_text())
    assert farm["temporary"] is True
    assert farm["root_pid"] == run.pid

    (listed,) = sessions(home)
    assert listed["session_id"] == sid
    assert listed["state"] == "running"
    assert listed["turns"] == 1
    assert listed["route"] == "s"
    assert "▶ shell" in cli(home, "show", sid).stdout
    other = cli(home, "run", "--workspace", str(ws), "too")  # would lose its farm midway
    assert other.returncode == 2
    assert "temporary farm of another" in other.stderr
    assert cli(home, "up", "--detach").returncode == 2
    down = cli(home, "down")
    assert down.returncode == 2
    assert "temporary farm" in down.stderr

    assert cli(home, "interrupt", sid).returncode == 0
    rest, _ = run.communicate(timeout=60)
    assert events_of(rest.decode())[-1]["payload"]["reason"] == "interrupted"
    assert run.returncode == 1
    assert not (home / "farm.json").exists()
    assert [p.pid for p in processes_naming(home)] == []


def test_no_terminal_and_ask_fails_fast_and_the_approval_waits(
        homes: list[Path], workspace_root: Path) -> None:
    home = make_home(workspace_root, "home", [shell("echo ran > effects.log"), text("done")],
                     approval="ask")
    homes.append(home)
    ws = make_ws(workspace_root)
    t0 = time.monotonic()
    r = cli(home, "run", "--workspace", str(ws), "go")
    assert r.returncode == 4, r.stderr
    print(f"\nno-TTY approval: exit 4 after {time.monotonic() - t0:.1f}s (farm start included)")
    err = one_line_error(r)
    (sid,) = re.findall(r"corral run --home \S+ --session (\S+) \(no prompt\)", err)
    assert "--approval allow|deny" in err
    assert not (ws / "effects.log").exists()
    (listed,) = sessions(home)  # the farm is stopped: read from the store
    assert listed["state"] == "waiting_for_approval"
    assert listed["pending_approval"]
    assert "? approval" in cli(home, "show", sid).stdout
    again = cli(home, "run", "--session", sid, "--json")  # attach: the same request again
    assert again.returncode == 4
    assert events_of(again.stdout)[-1]["type"] == "cli_error"
    assert any(e["type"] == "exec_approval_request" for e in events_of(again.stdout))


# -- sessions, terminate, delete ------------------------------------------------------


def test_sessions_states_filters_and_offline_terminate_delete(homes: list[Path],
                                                      workspace_root: Path) -> None:
    home = make_home(workspace_root, "home", [shell("echo x"), text("ok")])
    homes.append(home)
    ws = make_ws(workspace_root)
    assert cli(home, "run", "--workspace", str(ws), "one").returncode == 0
    bad = make_home(workspace_root, "bad-script-dir", [{"status": 400,
                                                        "error_message": "no"}])
    failed = cli(home, "run", "--workspace", str(ws), "--model",
                 f"script:{bad / 'script.json'}", "two")
    assert failed.returncode == 1
    listed = sessions(home)
    assert [s["state"] for s in listed] == ["failed", "idle"]  # most recently active first
    assert listed[0]["last_active_at"] >= listed[1]["last_active_at"]
    assert all(s["turns"] == 1 and s["workspace"] == str(ws) for s in listed)
    idle, failed_id = listed[1]["session_id"], listed[0]["session_id"]
    assert [s["session_id"] for s in sessions(home, "--state", "idle")] == [idle]
    assert len(sessions(home, "--since", "1h")) == 2
    assert sessions(home, "--since", "2999-01-01") == []
    assert cli(home, "sessions", "--since", "yesterday").returncode == 2
    table = cli(home, "sessions").stdout
    assert re.search(rf"{idle}\s+idle\s+1\s+\d{{4}}-\d\d-\d\d \d\d:\d\d\s+\d+[smh] ago\s+s\s+",
                     table), table

    # Offline (no farm): terminate marks it closed in the store; run refuses it.
    assert cli(home, "terminate", idle).returncode == 0
    assert sessions(home, "--state", "terminated")[0]["session_id"] == idle
    refused = cli(home, "run", "--session", idle, "more")
    assert refused.returncode == 2
    assert "terminated" in refused.stderr

    # Offline delete.
    assert cli(home, "delete", failed_id, "--yes", "--json").returncode == 0
    assert [s["session_id"] for s in sessions(home)] == [idle]
    assert "no session" in cli(home, "show", failed_id).stderr


def test_terminate_and_delete_with_a_farm(homes: list[Path], workspace_root: Path) -> None:
    """terminate aborts the running turn and refuses new ones; delete asks, or takes --yes."""
    slow = make_home(workspace_root, "slow", [shell("sleep 60"), text("never")])
    homes.append(slow)
    _up(slow)
    procs_ws = make_ws(workspace_root, "ws2")
    runner = subprocess.Popen([PYTHON, "-m", "supervisor.cli", "run", "--home", str(slow),
                               "--workspace", str(procs_ws), "--json", "go"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              stdin=subprocess.DEVNULL, cwd=REPO)
    try:
        first = json.loads(read_line_with_deadline(runner, 60))
        sid = first["session_id"]
        wait_until(lambda: sessions(slow)[0]["state"] == "running", timeout_s=60,
                   what="the turn to run")
        term = cli(slow, "terminate", sid)
        assert term.returncode == 0, term.stderr
        runner.wait(timeout=60)
        assert runner.returncode == 1
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
        if runner.stdout is not None:
            runner.stdout.close()
    assert sessions(slow)[0]["state"] == "terminated"
    assert cli(slow, "run", "--session", sid, "again").returncode == 2
    no_tty = cli(slow, "delete", sid)
    assert no_tty.returncode == 2
    assert "--yes" in no_tty.stderr
    assert cli(slow, "delete", sid, "--yes").returncode == 0
    assert sessions(slow) == []
    assert cli(slow, "delete", sid, "--yes").returncode == 1
    assert cli(slow, "down").returncode == 0


def test_workers_zero_starts_no_local_worker(homes: list[Path], workspace_root: Path) -> None:
    home = make_home(workspace_root, "home", [text("hi")])
    homes.append(home)
    r = cli(home, "up", "--detach", "--workers", "0", "--json")
    assert r.returncode == 0, r.stderr
    names = {c["name"] for c in json.loads(r.stdout)["children"]}
    assert names == {"fakellm-s", "broker", "supervisor"}
    assert cli(home, "down").returncode == 0
    assert cli(home, "up", "--workers", "-1").returncode == 2
    lonely = cli(home, "run", "--workers", "0", "--workspace", str(home), "hi")
    assert lonely.returncode == 2  # a temporary farm nobody could ever serve
    assert "backend_tcp" in lonely.stderr


# -- honest errors at the edges -----------------------------------------------------------


def test_a_malformed_script_is_one_line(homes: list[Path], workspace_root: Path) -> None:
    home = make_home(workspace_root, "home", [text("hi")])
    homes.append(home)
    ws = make_ws(workspace_root)
    (home / "script.json").write_text('{"responses": [{"text": 3}]')
    r = cli(home, "run", "--workspace", str(ws), "go")
    assert r.returncode == 2
    err = one_line_error(r)
    assert re.search(r"fakellm-s failed to start: error: cannot read script .*script\.json", err)
    inline = cli(home, "run", "--workspace", str(ws), "--model",
                 f"script:{home / 'script.json'}", "go")
    assert inline.returncode == 2
    assert "fakellm-run failed to start" in one_line_error(inline)

    detached = cli(home, "up", "--detach")
    assert detached.returncode == 1
    line = one_line_error(detached)
    assert "the farm exited during start-up (exit 1): farm failed: fakellm-s failed to start: " \
           "error: cannot read script" in line
    assert "farm.log" in line


@pytest.mark.parametrize(("content", "needle"), [
    (b"[farm]\nworkers = 2\n# caf\xe9\n", "not UTF-8 text (byte 0xe9 on line 3)"),
    (b"[farm]\nworkers = 'two'\n", "[farm.workers] must be an integer, got 'two'"),
    (b"[farm]\nheartbeat_interval_s = true\n", "must be a number, got True"),
    (b"[sandbox]\nnetwork = 1\n", "must be true or false, got 1"),
    (b"farm = 3\n", "[farm] must be a table"),
    (b"[[hooks.pre_tool]]\ncommand = 'x'\ntimeout_s = 0\n", "timeout_s] must be above 0"),
    (b"[[hooks.pre_tol]]\ncommand = 'x'\n", "unknown hook event"),
    # the line and the key, a typo with its likely meaning, a number out of range
    # (liveness -1 reached the broker's argument check: exit 1 after a farm start)
    (b"[farm]\n\nworkres = 2\n", "corral.toml, line 3: [farm] unknown key(s) ['workres'] "
     "(did you mean 'workers'?)"),
    (b"# heartbeats\n[farm]\nliveness = -1\n", "corral.toml, line 3: [farm.liveness] must "
     "be at least 1, got -1"),
    (b"[farm]\nliveness = \n", "corral.toml, line 2: not valid TOML: Invalid value"),
])
def test_config_errors_are_said_in_words(tmp_path: Path, content: bytes, needle: str) -> None:
    (tmp_path / "corral.toml").write_bytes(content)
    for command in (("up", "--detach"), ("run", "go")):
        r = cli(tmp_path, *command)
        assert r.returncode == 2, r.stderr
        assert needle in one_line_error(r)
    assert not (tmp_path / "farm.json").exists()


def test_a_closed_port_names_the_url_on_every_retry(homes: list[Path],
                                                     workspace_root: Path) -> None:
    home = workspace_root / "home"
    home.mkdir()
    homes.append(home)
    (home / "corral.toml").write_text(
        '[session]\napproval = "allow"\n[routes.main]\nprovider = "openai-chat"\n'
        'model = "m"\nbase_url = "http://127.0.0.1:9/v1"\nmax_retries = 1\n')
    ws = make_ws(workspace_root)
    r = cli(home, "run", "--workspace", str(ws), "hi")
    assert r.returncode == 1
    one_line_error(r)
    url = "http://127.0.0.1:9/v1/chat/completions"
    retries = [ln for ln in r.stdout.splitlines() if "model step retrying" in ln]
    assert retries, r.stdout
    assert all(url in ln for ln in retries), r.stdout
    assert all("connect_error" in ln for ln in retries), r.stdout
    final = [ln for ln in r.stdout.splitlines() if "turn aborted" in ln]
    assert final
    assert url in final[0]
    assert "check the route's base_url" in final[0]


def test_down_without_a_farm_is_a_quiet_success(tmp_path: Path) -> None:
    for _ in range(2):
        r = cli(tmp_path / "nothing", "down")
        assert r.returncode == 0
        assert "nothing to stop" in r.stdout
        assert not r.stderr


def test_a_closed_stdout_ends_quietly(homes: list[Path], workspace_root: Path) -> None:
    home = make_home(workspace_root, "home", [shell("seq 1 3000"), text("done")])
    homes.append(home)
    ws = make_ws(workspace_root)
    cmd = (f"set -o pipefail; {PYTHON} -m supervisor.cli run --home {home} --workspace {ws} "
           "--json go | head -3")
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120,
                       cwd=REPO, stdin=subprocess.DEVNULL, env=NO_KEYS)
    assert len(r.stdout.splitlines()) == 3
    assert "Traceback" not in r.stderr, r.stderr
    assert "BrokenPipe" not in r.stderr, r.stderr
    assert r.returncode == 141
    assert not (home / "farm.json").exists()
    wait_until(lambda: not processes_naming(home), timeout_s=30, what="the farm to stop")
    (sid,) = [s["session_id"] for s in sessions(home)]
    shown = subprocess.run(["bash", "-c", f"{PYTHON} -m supervisor.cli show {sid} --home "
                            f"{home} | head -1"], capture_output=True, text=True, timeout=60,
                           cwd=REPO)
    assert shown.stdout.count("\n") == 1
    assert "Traceback" not in shown.stderr


def test_hooks_in_the_config_file_run_in_the_sandbox(homes: list[Path],
                                                     workspace_root: Path) -> None:
    home = make_home(workspace_root, "home", [shell("echo ran > effects.log"),
                                              shell("echo ran2 > effects2.log"), text("ok")])
    homes.append(home)
    ws = make_ws(workspace_root)
    with (home / "corral.toml").open("a") as f:
        f.write("[[hooks.pre_tool]]\n"
                "command = '''if grep -q effects2 ; then sleep 30; else "
                "id -u > hook-uid.txt; echo '{\"deny\": \"not on my watch\"}'; fi'''\n"
                "timeout_s = 3\n")
    r = cli(home, "run", "--workspace", str(ws), "--json", "go")
    assert r.returncode == 0, r.stderr
    ends = [e["payload"] for e in events_of(r.stdout) if e["type"] == "tool_call_end"]
    assert len(ends) == 2
    assert "not on my watch" in json.dumps(ends[0])
    assert "timed out" in json.dumps(ends[1])  # a timeout counts as deny
    assert not (ws / "effects.log").exists()
    assert not (ws / "effects2.log").exists()
    assert int((ws / "hook-uid.txt").read_text()) != 0  # ran as the sandbox's uid


def test_fake_llm_killed_by_pid_leaves_nothing(tmp_path: Path, procs: Procs) -> None:
    script = tmp_path / "s.json"
    script.write_text('{"responses": [{"text": "hi"}]}')
    proc = procs.spawn([PYTHON, "-m", "supervisor.cli", "fake-llm", "--script", str(script)],
                       name="fake-llm", stdout=subprocess.PIPE)
    ready = json.loads(read_line_with_deadline(proc, 30))
    assert ready["pid"] == proc.pid  # the CLI became the server (exec)
    assert psutil.Process(proc.pid).children(recursive=True) == []
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert not alive(ready["pid"])
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    r = cli(None, "fake-llm", "--script", str(bad))
    assert r.returncode == 2
    assert "cannot read script" in one_line_error(r)


def test_usage_errors_and_a_home_that_is_a_file(tmp_path: Path) -> None:
    """With --json every failure is a JSON document, usage errors included (argparse
    printed only its usage text); a --home (or $CORRAL_HOME) that is a file, or lies
    under one, is refused at once (run printed a FileExistsError traceback, status said
    to start a farm there, show to check the file's permissions)."""
    missing = cli(None, "approve", "sess_x", "--json")
    assert missing.returncode == 2
    doc = json.loads(missing.stdout)
    assert doc["ok"] is False
    assert doc["error"]["kind"] == "usage"
    assert "--decision" in doc["error"]["message"]
    assert "usage: corral approve" in missing.stderr

    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    status = cli(afile, "status", "--json")
    assert status.returncode == 2
    assert json.loads(status.stdout)["error"]["message"].endswith(
        f"{afile} is a file; give a directory (it is made when missing)")
    run = cli(afile / "sub", "run", "hi")
    assert run.returncode == 2
    assert f"{afile / 'sub'} is under {afile}, a file" in one_line_error(run)
    env = {**NO_KEYS, "CORRAL_HOME": str(afile)}
    assert cli(None, "sessions", env=env).returncode == 2

    level = cli(None, "--log-level", "loud", "down")
    assert level.returncode == 2
    assert "invalid choice: 'LOUD'" in one_line_error(level)

    no_prompt = cli(tmp_path / "home", "run", "--json")
    assert no_prompt.returncode == 2
    line = json.loads(no_prompt.stdout)
    assert line["type"] == "cli_error"
    assert line["ok"] is False
    assert line["error"]["kind"] == "usage"


def test_failures_of_import_and_keys_are_json_with_json(tmp_path: Path) -> None:
    """corral import and corral keys said their refusals only on stderr under --json."""
    gone = cli(tmp_path / "home", "import", str(tmp_path / "missing.json"), "--json")
    assert gone.returncode == 2
    assert json.loads(gone.stdout)["error"]["kind"] == "cannot_read"
    afile = tmp_path / "afile"
    afile.write_text("x")
    keys = cli(None, "keys", "new", "k1", "--dir", str(afile / "sub"), "--json")
    assert keys.returncode == 2
    assert json.loads(keys.stdout)["error"]["kind"] == "keys"


def test_a_prompt_from_stdin_and_refusals_before_any_farm(homes: list[Path],
                                                          workspace_root: Path) -> None:
    """'corral run -' reads the prompt from stdin (one argument holds at most 128 KiB,
    so a long prompt had no way in: '-' itself was sent as the prompt); a prompt over
    the turn's limit, a missing workspace and an empty stdin are refused (exit 2)
    before a temporary farm starts (the farm started, made a session for the too-long
    prompt and then failed it; a missing workspace cost a farm start and exit 1)."""
    home = make_home(workspace_root, "home", [text("got it")])
    homes.append(home)
    ws = make_ws(workspace_root)
    long_prompt = "word " * 40_000 + "END"  # 200 KB, over one argument's 128 KiB
    argv = [PYTHON, "-m", "supervisor.cli", "run", "--home", str(home), "--workspace",
            str(ws), "--json", "-"]
    r = subprocess.run(argv, input=long_prompt + "\n", capture_output=True, text=True,
                       timeout=120, cwd=REPO, env=NO_KEYS)
    assert r.returncode == 0, r.stderr
    events = events_of(r.stdout)
    given = [e["payload"] for e in events if e["type"] == "user_message"]
    assert given, r.stdout[-2000:]
    shown = str(given[0]["text"])  # an event shows a long text's head and its length
    cut = re.search(r"\n\[\.\.\. (\d+) characters cut\]$", shown)
    assert cut is not None, shown[-200:]
    assert len(shown) - len(cut.group(0)) + int(cut.group(1)) == len(long_prompt)
    assert long_prompt.startswith(shown[:cut.start()])

    for stdin, args, needle in (
            ("x" * 300_000, ("--workspace", str(ws), "-"), "bytes of input at a time"),
            ("", ("--workspace", str(ws), "-"), "the prompt on stdin is empty"),
            ("", ("--workspace", str(ws / "nothere"), "hi"), "nothere does not exist")):
        refused = subprocess.run([PYTHON, "-m", "supervisor.cli", "run", "--home", str(home),
                                  *args], input=stdin, capture_output=True, text=True,
                                 timeout=60, cwd=REPO, env=NO_KEYS)
        assert refused.returncode == 2, refused.stderr
        assert needle in one_line_error(refused)
        assert "starting a temporary one" not in refused.stderr
    unknown = cli(home, "run", "--session", "sess_nope", "hi")  # no farm was started
    assert unknown.returncode == 1
    assert "no session 'sess_nope'" in one_line_error(unknown)
    assert "starting a temporary one" not in unknown.stderr
    assert len(sessions(home)) == 1


def test_chaos_and_fake_llm_refuse_out_of_range_numbers(tmp_path: Path) -> None:
    """'corral chaos --duration -5' ran a whole chaos run, '--sessions 0' never ended
    (it waited for sessions it did not run), and a bad --faults word was printed on
    stdout as text under --json; now each is a usage error, JSON with --json."""
    from supervisor.cli import build_parser

    bogus = cli(None, "chaos", "--faults", "bogus", "--json", timeout_s=60)
    assert bogus.returncode == 2
    assert json.loads(bogus.stdout)["error"]["kind"] == "usage"
    negative = cli(None, "chaos", "--duration", "-5", "--json", timeout_s=60)
    assert negative.returncode == 2
    assert "--duration: must be above 0, got -5" in json.loads(negative.stdout)["error"][
        "message"]
    parser = build_parser()
    for argv in (["chaos", "--sessions", "0"], ["chaos", "--workers", "0"],
                 ["chaos", "--frame-rate", "0.9"], ["chaos", "--fault-gap", "0"],
                 ["fake-llm", "--script", "s.json", "--port", "70000"],
                 # the worker said these only after its sandbox probe, with exit 0
                 ["worker", "--broker", "ipc:///x", "--capacity", "0"],
                 ["worker", "--broker", "ipc:///x", "--drain-s", "-1"],
                 ["worker", "--broker", "ipc:///x", "--liveness", "0"],
                 ["run", "--timeout-s", "-1", "hi"]):
        with pytest.raises(SystemExit) as leaving:
            parser.parse_args(argv)
        assert leaving.value.code == 2, argv
