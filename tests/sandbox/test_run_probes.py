"""Workspace probes through ``corral run`` as a user drives it: a hostile
scripted model (``script:`` route, the real fake-llm server) against a real
ephemeral farm, with the host's state checked afterwards.

Covers issue 13's classes 1-4 end to end (setuid plants, nested workspaces,
the farm's home inside a workspace, ``.git``) and issue 16's workspace
checks at session creation (missing, a file, read-only mode).

Most tests run against one farm for the module (``corral up --detach`` with
one worker; each ``corral run`` still starts its own scripted provider): a
temporary farm per run cost about 4 CPU-s each (docs/testing.md). The farm's
home and run dir checks keep a temporary farm of their own.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from supervisor.farm.layout import FarmPaths
from tests.helpers import PYTHON, REPO, kill_tree, searchable_dir

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(240)]

OWNER = 4242


def _shell(command: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "shell", "arguments": {"command": command}}]}


def _text(t: str) -> dict[str, Any]:
    return {"text": t, "usage": {"input": 10, "output": 3}}


def _kill_named(path: Path) -> None:
    """Every process whose command line names ``path`` (the farms name their home)."""
    for p in psutil.process_iter(["cmdline"]):
        if str(path) in " ".join(p.info["cmdline"] or []) and p.pid != os.getpid():
            kill_tree(p.pid)


@pytest.fixture
def root() -> Iterator[Path]:
    with searchable_dir("corral-probe-", "/tmp") as path:
        yield path
        _kill_named(path)


@pytest.fixture(scope="module")
def home() -> Iterator[Path]:
    """A farm for the module: one sandbox worker, stopped with ``corral down``,
    then every process naming its home is killed by pid."""
    with searchable_dir("corral-probe-farm-", "/tmp") as path:
        home = path / "home"
        home.mkdir()
        (home / "corral.toml").write_text("[farm]\nworkers = 1\n")
        try:
            up = corral(home, "up", "--detach", "--json")
            assert up.returncode == 0, up.stderr
            yield home
        finally:
            corral(home, "down")
            _kill_named(path)


def _script(root: Path, name: str, *responses: dict[str, Any]) -> Path:
    path = root / f"{name}.json"
    path.write_text(json.dumps({"responses": [*responses, _text("done")]}))
    return path


def corral(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", "supervisor.cli", *args, "--home", str(home)],
                          capture_output=True, text=True, timeout=180, cwd=REPO,
                          stdin=subprocess.DEVNULL)


def run(home: Path, script: Path, workspace: Path, *extra: str,
        ) -> subprocess.CompletedProcess[str]:
    return corral(home, "run", "--json", "--approval", "allow", "--model", f"script:{script}",
                  "--workspace", str(workspace), *extra, "go")


def _events(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def _tool_results(out: str) -> list[dict[str, Any]]:
    return [e["payload"] for e in _events(out) if e["type"] == "tool_call_end"]


def _user_ws(root: Path, name: str = "ws") -> Path:
    ws = root / name
    ws.mkdir()
    os.chown(ws, OWNER, OWNER)
    return ws


def test_setuid_plants_and_foreign_owners_never_reach_the_host(root: Path,
                                                               home: Path) -> None:
    ws = _user_ws(root)
    script = _script(root, "plant", _shell(
        "cp /usr/bin/id x && chmod 6755 x; cp /usr/bin/id y; chmod u+s y; chmod g+s y; "
        "install -m 2755 /usr/bin/id z; mkdir d; chmod 2777 d; echo hi > d/f; ls -ln"))
    r = run(home, script, ws)
    assert r.returncode == 0, r.stderr + r.stdout
    for path, dirs, files in os.walk(ws):
        for name in dirs + files:
            st = os.lstat(os.path.join(path, name))
            assert not st.st_mode & (stat.S_ISUID | stat.S_ISGID), (name, oct(st.st_mode))
            assert (st.st_uid, st.st_gid) == (OWNER, OWNER), (name, st.st_uid, st.st_gid)
    # The farm's own files are private.
    assert stat.S_IMODE(os.stat(home / "corral.db").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(home).st_mode) == 0o700


def test_nested_workspaces_are_refused_whatever_the_session(root: Path, home: Path) -> None:
    area = root / "area"
    area.mkdir()
    outer = _user_ws(area, "outer")
    (outer / "sub").mkdir()
    ok = run(home, _script(root, "a"), outer)
    assert ok.returncode == 0, ok.stderr + ok.stdout
    for inner in (outer / "sub", area):
        r = run(home, _script(root, "b"), inner)
        assert r.returncode != 0
        err = [e for e in _events(r.stdout) if e["type"] == "cli_error"]
        assert err, r.stdout + r.stderr
        assert "contains or lies inside" in err[0]["message"]
    # The same directory again is the same workspace: allowed.
    again = run(home, _script(root, "c"), outer)
    assert again.returncode == 0, again.stderr + again.stdout


@pytest.mark.parametrize("where", ["home-in-workspace", "workspace-in-home"])
def test_the_farm_home_and_a_workspace_never_overlap(root: Path, where: str) -> None:
    ws = _user_ws(root)
    home = ws / ".corral" if where == "home-in-workspace" else root / "home"
    workspace = ws if where == "home-in-workspace" else home / "logs"
    if where == "workspace-in-home":
        (home / "logs").mkdir(parents=True)
    r = run(home, _script(root, "x", _shell("echo pwned > $(find / -name corral.db)")),
            workspace)
    assert r.returncode != 0
    err = [e for e in _events(r.stdout) if e["type"] == "cli_error"]
    assert err, r.stdout + r.stderr
    assert "overlaps the farm's own directory" in err[0]["message"]
    assert not [e for e in _events(r.stdout) if e["type"] == "tool_call_begin"]


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_a_missing_workspace_or_a_file_is_refused_before_the_session(root: Path, home: Path,
                                                                     kind: str) -> None:
    target = root / "nothere"
    if kind == "file":
        target.write_text("a file\n")
    r = run(home, _script(root, "m"), target)
    assert r.returncode != 0
    assert "session" not in [e["type"] for e in _events(r.stdout)]
    assert ("does not exist" if kind == "missing" else "is not a directory") in \
        r.stdout + r.stderr
    listed = corral(home, "sessions", "--json")
    assert str(target) not in listed.stdout


def test_git_config_and_hooks_stay_read_only_unless_allowed(root: Path, home: Path) -> None:
    ws = _user_ws(root)
    subprocess.run(["git", "init", "-q", str(ws)], check=True)
    config = (ws / ".git" / "config").read_text()
    attack = _shell("git config core.fsmonitor 'touch /tmp/pwned'; "
                    "echo 'touch /tmp/pwned' > .git/hooks/pre-commit; "
                    "echo '[core]' > .git/config; ls .git/hooks")
    write = {"tool_calls": [{"name": "write_file", "arguments": {
        "path": ".git/hooks/post-checkout", "content": "#!/bin/sh\ntouch /tmp/pwned\n"}}]}
    r = run(home, _script(root, "g", attack, write), ws)
    assert r.returncode == 0, r.stderr + r.stdout
    assert (ws / ".git" / "config").read_text() == config
    assert not (ws / ".git" / "hooks" / "pre-commit").exists()
    assert not (ws / ".git" / "hooks" / "post-checkout").exists()
    results = _tool_results(r.stdout)
    assert any("read-only" in str(x) for x in results), results
    allowed = run(home, _script(root, "h", _shell("git config user.name agent")),
                  ws, "--allow-git-write")
    assert allowed.returncode == 0, allowed.stderr + allowed.stdout
    assert "agent" in (ws / ".git" / "config").read_text()


def test_read_only_sandbox_mode_through_the_cli(root: Path, home: Path) -> None:
    ws = _user_ws(root)
    (ws / "keep.txt").write_text("keep\n")
    r = run(home, _script(root, "ro", _shell("cat keep.txt; echo x > keep.txt; "
                                                      "touch new")), ws,
            "--sandbox", "read-only")
    assert r.returncode == 0, r.stderr + r.stdout
    assert (ws / "keep.txt").read_text() == "keep\n"
    assert sorted(os.listdir(ws)) == ["keep.txt"]


def test_the_run_dir_of_a_deep_home_is_private(root: Path) -> None:
    deep = root / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    r = run(deep, _script(root, "r"), _user_ws(root))
    assert r.returncode == 0, r.stderr + r.stdout
    assert stat.S_IMODE(os.stat(FarmPaths.of(deep).run).st_mode) == 0o700


def test_a_hostile_run_leaves_no_grant_and_nothing_a_host_user_can_use(root: Path,
                                                                       home: Path) -> None:
    """Issue 16: after a run, the workspace is the owner's (no Corral ACL entry,
    nothing of a sandbox uid) and another local user gains nothing: not even
    through ACLs or modes a tool set on its own files."""
    import pwd

    from tests.sandbox.test_acl_calls import HOSTILE, as_user, leftovers

    ws = _user_ws(root)
    (ws / "private.txt").write_text("the user's secret\n")
    os.chown(ws / "private.txt", OWNER, OWNER)
    (ws / "private.txt").chmod(0o600)
    write = {"tool_calls": [{"name": "write_file",
                             "arguments": {"path": "w/new.txt", "content": "x"}}]}
    script = _script(root, "hostile", _shell(HOSTILE), write,
                     _shell("cat private.txt > /dev/null; ls -la"))
    r = run(home, script, ws)
    assert r.returncode == 0, r.stderr + r.stdout
    assert all(not t["is_error"] for t in _tool_results(r.stdout)), r.stdout
    uids = range(200_000, 200_000 + 65_536)
    assert leftovers(ws, uids, pwd.getpwnam("corral-sandbox").pw_uid) == []
    stranger = as_user(4243, f"cd {ws}; cat private.txt; echo x > d/e/f; "
                       "touch d/new w/new2; rm -f mine; true")
    assert "secret" not in stranger.stdout
    assert not (ws / "d" / "new").exists()
    assert not (ws / "w" / "new2").exists()
    assert (ws / "mine").exists()
    owner = as_user(OWNER, f"cd {ws} && chmod -R u+rwX . && rm -rf ./* && ls -A")
    assert owner.returncode == 0, owner.stderr
    assert owner.stdout.strip() == ""
