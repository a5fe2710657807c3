"""The human renderer in a real terminal: ``corral run`` inside tmux, driven with
``send-keys`` and read with ``capture-pane``.

Covers a live approval prompt (answered by typing, and answered from another
process after ``run --session`` re-showed it), Ctrl-C (interrupts the turn,
exit 130), a long tool output, and hostile escape sequences in tool output,
model text, arguments and file names: the operator's terminal keeps its
title, its clipboard (tmux buffers, with ``set-clipboard on``) and its
screen. A positive control prints the same sequences raw to prove this tmux
honours them, so the checks cannot pass vacuously. ``--json`` stays lossless.

Each test has its own tmux server (``-S`` socket under tmp); the server, the
pane's processes and the farms are killed by pid afterwards.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cli.test_cli_e2e import (
    events_of,
    make_home,
    make_ws,
    processes_naming,
    shell,
    spawn,
    text,
)
from tests.cli.test_first_hour import cli, sessions
from tests.helpers import PYTHON, REPO, Procs, kill_tree, read_line_with_deadline, wait_until

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux "
                                 "(scripts/_bootstrap.sh installs it)")]

# Hostile bytes a tool prints: OSC 52 (clipboard), OSC 0/2 (title), clear screen,
# cursor home/up, erase line, C1 CSI (0x9b), a bidi override, and a fake prompt.
EVIL_PRINTF = (r"printf 'before\n\033]52;c;cHduZWQ=\007\033]0;PWNED\007\033]2;PWNED\007"
               r"\033[2J\033[H\033[3A\033[2K\302\2332J\342\200\256gnirts"
               r"\napprove? [y]es FAKE\n'")
EVIL_MODEL = "model says \u001b]2;MODELTITLE\u0007\u001b]52;c;bW9kZWw=\u0007\u009b2J done"
EVIL_NAME = "evil\u001b]2;FILETITLE\u0007name"


class Tmux:
    def __init__(self, socket: Path) -> None:
        self.socket = socket

    def __call__(self, *args: str) -> str:
        r = subprocess.run(["tmux", "-S", str(self.socket), *args], capture_output=True,
                           text=True, timeout=30)
        assert r.returncode == 0, (args, r.stderr)
        return r.stdout

    def type(self, line: str) -> None:
        self("send-keys", "-t", "t", "-l", line)
        self("send-keys", "-t", "t", "Enter")

    def screen(self) -> str:
        return self("capture-pane", "-t", "t", "-p", "-J", "-S", "-3000")

    def wait_for(self, pattern: str, timeout_s: float = 90) -> re.Match[str]:
        found = wait_until(lambda: re.search(pattern, self.screen()), timeout_s=timeout_s,
                           what=f"{pattern!r} on the terminal")
        assert found is not None
        return found

    def exit_code(self) -> int:
        """Type ``echo EXIT=$?`` at the shell prompt (after the command ended)."""
        marker = f"EXIT{time.monotonic_ns()}"
        self.type(f"echo {marker}=$?")
        return int(self.wait_for(rf"\n{marker}=(\d+)").group(1))

    def title(self) -> str:
        return self("display-message", "-t", "t", "-p", "#{pane_title}").strip()

    def buffers(self) -> str:
        return self("list-buffers")


@pytest.fixture
def term(tmp_path: Path, workspace_root: Path) -> Iterator[Tmux]:
    t = Tmux(tmp_path / "tmux.sock")
    rc = workspace_root / "bashrc"
    rc.write_text(f"PS1='$ '\ncd {shlex.quote(str(REPO))}\nunset OPENAI_API_KEY "
                  "ANTHROPIC_API_KEY CORRAL_API_KEY\n")
    t("-f", "/dev/null", "new-session", "-d", "-s", "t", "-x", "200", "-y", "50",
      f"env -u TMUX TERM=xterm-256color bash --noprofile --rcfile {rc} -i")
    t("set-option", "-g", "set-clipboard", "on")
    t("select-pane", "-t", "t", "-T", "operator-title")
    server = int(t("display-message", "-p", "#{pid}").strip())
    pane = int(t("display-message", "-t", "t", "-p", "#{pane_pid}").strip())
    try:
        yield t
    finally:
        kill_tree(pane)
        subprocess.run(["tmux", "-S", str(t.socket), "kill-server"], capture_output=True,
                       timeout=30)
        kill_tree(server)


def corral_line(home: Path, *args: str) -> str:
    return " ".join(shlex.quote(a) for a in [PYTHON, "-m", "supervisor.cli", *args,
                                             "--home", str(home)])


def test_escape_sequences_never_reach_the_operators_terminal(
        term: Tmux, homes: list[Path], workspace_root: Path) -> None:
    ws = make_ws(workspace_root)
    (ws / EVIL_NAME).write_text("x")
    responses: list[dict[str, Any]] = [
        shell(EVIL_PRINTF),
        {"tool_calls": [{"name": "list_dir", "arguments": {"path": "."}}]},
        text(EVIL_MODEL),
    ]
    home = make_home(workspace_root, "home", responses)
    homes.append(home)
    term.type("clear; echo FIRST-LINE-STAYS")
    term.type(corral_line(home, "run", "--workspace", str(ws), "go"))
    term.wait_for(r"── turn complete")
    assert term.exit_code() == 0
    assert term.title() == "operator-title"
    assert term.buffers() == ""  # OSC 52 wrote no clipboard
    screen = term.screen()
    assert "FIRST-LINE-STAYS" in screen, screen  # no clear screen, no cursor games
    assert r"\x1b]52;c;cHduZWQ=\x07" in screen
    assert r"\x1b]0;PWNED\x07\x1b]2;PWNED\x07\x1b[2J\x1b[H\x1b[3A\x1b[2K\x9b2J" in screen
    assert r"\u202egnirts" in screen
    assert r"model says \x1b]2;MODELTITLE\x07\x1b]52;c;bW9kZWw=\x07\x9b2J done" in screen
    assert r"evil\x1b]2;FILETITLE\x07name" in screen

    # Control: the same terminal does honour these sequences when printed raw.
    term.type(r"printf '\033]2;RAW-TITLE\007\033]52;c;cmF3\007'; echo; echo CONTROL-DONE")
    term.wait_for(r"\nCONTROL-DONE")
    wait_until(lambda: term.title() == "RAW-TITLE", timeout_s=10, what="the raw title")
    assert term.buffers() != ""

    # --json is lossless: the exact bytes, escaped by JSON itself.
    r = cli(home, "run", "--workspace", str(ws), "--json", "again")
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout
    assert "\u202e" not in r.stdout
    events = events_of(r.stdout)
    ends = [e["payload"] for e in events if e["type"] == "tool_call_end"]
    assert "\x1b]52;c;cHduZWQ=\x07\x1b]0;PWNED\x07" in ends[0]["output"]
    assert "\u202egnirts" in ends[0]["output"]
    # list_dir itself shows a name with control characters escaped (ls -b style,
    # flagged), as the model sees it; --json carries that output unchanged
    assert r"evil\x1b]2;FILETITLE\x07name" in ends[1]["output"]
    assert "name shown escaped" in ends[1]["output"]
    said = [e["payload"]["text"] for e in events if e["type"] == "agent_message"]
    assert said == [EVIL_MODEL]


def test_a_live_approval_prompt_answered_by_typing(term: Tmux, homes: list[Path],
                                                   workspace_root: Path) -> None:
    home = make_home(workspace_root, "home", [shell("echo ok > effects.log"), text("done")],
                     approval="ask")
    homes.append(home)
    ws = make_ws(workspace_root)
    term.type(corral_line(home, "run", "--workspace", str(ws), "go"))
    term.wait_for(r"\? approval approval_\w+ needed: shell\(\{\"command\": \"echo ok")
    term.wait_for(r"approve\? \[y\]es / \[a\]lways this session / \[n\]o / abort turn \[x\]:")
    assert not (ws / "effects.log").exists()
    term.type("maybe")  # not an answer: asked again
    term.wait_for(r"maybe\napprove\? \[y\]es")
    term.type("y")
    term.wait_for(r"── turn complete")
    assert term.exit_code() == 0
    assert (ws / "effects.log").read_text() == "ok\n"


def test_run_session_shows_a_pending_approval_left_by_an_earlier_client(
        term: Tmux, homes: list[Path], workspace_root: Path) -> None:
    home = make_home(workspace_root, "home", [shell("echo ok > effects.log"), text("done")],
                     approval="ask")
    homes.append(home)
    ws = make_ws(workspace_root)
    first = cli(home, "run", "--workspace", str(ws), "go")  # no terminal: exits 4
    assert first.returncode == 4, first.stderr
    (sid,) = re.findall(r"--session (\S+) \(no prompt\)", first.stderr)
    term.type(corral_line(home, "run", "--session", sid))
    found = term.wait_for(r"\? approval (approval_\w+) needed: shell")
    term.wait_for(r"approve\? \[y\]es")
    # The temporary farm of that run is reachable: answer from another process.
    approved = cli(home, "approve", sid, found.group(1), "--decision", "approved")
    assert approved.returncode == 0, approved.stderr
    term.wait_for(r"── turn complete")
    assert term.exit_code() == 0
    assert (ws / "effects.log").read_text() == "ok\n"
    assert sessions(home)[0]["state"] == "idle"


def test_ctrl_c_interrupts_the_turn(term: Tmux, homes: list[Path],
                                    workspace_root: Path) -> None:
    home = make_home(workspace_root, "home", [shell("echo started; sleep 120"),
                                              text("never")])
    homes.append(home)
    ws = make_ws(workspace_root)
    term.type(corral_line(home, "run", "--workspace", str(ws), "go"))
    term.wait_for(r"\nstarted")
    t0 = time.monotonic()
    term("send-keys", "-t", "t", "C-c")
    term.wait_for(r"── turn aborted: interrupted")
    term.wait_for(r"corral: interrupted the turn \(Ctrl-C\)")
    assert term.exit_code() == 130
    print(f"\nCtrl-C to the shell prompt: {time.monotonic() - t0:.2f}s")
    (listed,) = sessions(home)
    assert listed["state"] == "idle"
    assert listed["last_turn"]["outcome"] == "aborted"
    wait_until(lambda: not processes_naming(home), timeout_s=30,
               what="the temporary farm to be gone")


def test_a_long_tool_output_streams_to_the_end(term: Tmux, homes: list[Path],
                                               workspace_root: Path) -> None:
    home = make_home(workspace_root, "home", [shell("seq 1 30000"), text("counted")])
    homes.append(home)
    ws = make_ws(workspace_root)
    term.type(corral_line(home, "run", "--workspace", str(ws), "go"))
    term.wait_for(r"── turn complete", timeout_s=120)
    assert term.exit_code() == 0
    screen = term.screen()
    assert "\ncounted" in screen
    numbers = [int(ln) for ln in screen.splitlines() if ln.isdigit()]
    if numbers[-1] != numbers[-2] + 1:  # the stream was cut inside a line
        assert str(numbers[-2] + 1).startswith(str(numbers[-1]))
        numbers.pop()
    assert numbers == list(range(numbers[0], numbers[-1] + 1))  # in order, none lost
    assert numbers[-1] >= 10_000
    end = re.search(r"\n(\d*)\n?✓ shell ok \[sandbox T2\]( … \[\.\.\. \d+ characters cut\])?",
                    screen)
    assert end is not None, screen[-3000:]
    if numbers[-1] < 30_000:  # the farm bounds a result; the cut is said, not hidden
        assert end.group(2), screen[-3000:]


def test_ctrl_c_at_the_approval_prompt_then_delete_asks(term: Tmux, homes: list[Path],
                                                        workspace_root: Path) -> None:
    home = make_home(workspace_root, "home", [shell("echo ok > effects.log"), text("done")],
                     approval="ask")
    homes.append(home)
    ws = make_ws(workspace_root)
    term.type(corral_line(home, "run", "--workspace", str(ws), "go"))
    term.wait_for(r"approve\? \[y\]es")
    term("send-keys", "-t", "t", "C-c")
    term.wait_for(r"── turn aborted: interrupted")
    assert term.exit_code() == 130
    assert not (ws / "effects.log").exists()
    (listed,) = sessions(home)
    assert listed["state"] == "idle"
    sid = listed["session_id"]

    term.type(corral_line(home, "delete", sid))
    term.wait_for(r"This cannot be undone\. \[y/N\]")
    term.type("n")
    term.wait_for(r"\nnot deleted")
    assert term.exit_code() == 1
    assert len(sessions(home)) == 1
    term.type(corral_line(home, "delete", sid))
    wait_until(lambda: term.screen().count("[y/N]") == 2, timeout_s=60,
               what="the second confirmation question")
    term.type("y")
    term.wait_for(rf"session {sid} deleted")
    assert term.exit_code() == 0
    assert sessions(home) == []


def test_ctrl_c_never_interrupts_another_clients_turn_and_a_second_one_leaves(
        term: Tmux, homes: list[Path], workspace_root: Path, procs: Procs) -> None:
    home = make_home(workspace_root, "home", [shell("echo started; sleep 120"),
                                              text("never")])
    homes.append(home)
    ws = make_ws(workspace_root)
    up = cli(home, "up", "--detach", "--workers", "1")
    assert up.returncode == 0, up.stderr
    other = spawn(procs, home, "run", "--workspace", str(ws), "--json", "go",
                  stdout=subprocess.PIPE)
    sid = json.loads(read_line_with_deadline(other, 60))["session_id"]
    wait_until(lambda: sessions(home)[0]["state"] == "running", timeout_s=60,
               what="the other client's turn to run")
    term.type(corral_line(home, "run", "--session", sid, "me too"))
    term.wait_for(r"▶ shell")  # the other turn, replayed from its start
    term("send-keys", "-t", "t", "C-c")
    term.wait_for(r"this run's input waits behind another turn, which is left alone")
    term("send-keys", "-t", "t", "C-c")
    term.wait_for(r"corral: detached \(second Ctrl-C\); the turn goes on in the farm: "
                  rf"corral interrupt {sid}")
    assert term.exit_code() == 130
    assert sessions(home)[0]["state"] == "running"  # really left alone
    assert other.poll() is None
    assert cli(home, "interrupt", sid).returncode == 0
    assert other.wait(timeout=60) == 1
    assert cli(home, "down").returncode == 0
