"""The corral CLI's surface: --help everywhere, clear errors that say what to do."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.cli import build_parser

COMMANDS = sorted(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]


def corral(
    *args: str, home: Path | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "supervisor.cli", *args]
    if home is not None:
        argv += ["--home", str(home)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def help_text(*words: str) -> str:
    """``corral WORDS --help``'s output, from the CLI's own parser in this process
    (the same text the command prints: one real process per command cost ~1 s
    each on a loaded machine)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        build_parser().parse_args([*words, "--help"])
    assert done.value.code == 0, words
    return out.getvalue()


def test_every_command_has_help() -> None:
    assert {"up", "down", "status", "run", "approve", "interrupt", "sessions", "show",
            "export", "verify", "import", "fake-llm", "chaos"} <= set(COMMANDS)
    top = corral("--help")
    assert top.returncode == 0
    for command in COMMANDS:
        assert command in top.stdout
    # one subcommand through a real process: the same text as in this process
    real = corral("run", "--help")
    assert real.returncode == 0, real.stderr
    assert real.stdout == help_text("run")
    for command in COMMANDS:
        assert "usage: corral " + command in help_text(command), command


@pytest.mark.parametrize("command", ["status", "interrupt S", "approve S A --decision denied"])
def test_commands_without_a_farm_say_how_to_start_one(tmp_path: Path, command: str) -> None:
    result = corral(*command.split(), home=tmp_path / "nofarm")
    assert result.returncode == 3
    assert "corral up" in result.stderr


def test_json_errors_are_json(tmp_path: Path) -> None:
    result = corral("status", "--json", home=tmp_path / "nofarm")
    assert result.returncode == 3
    doc = json.loads(result.stdout)
    assert doc["ok"] is False
    assert doc["error"]["kind"] == "unavailable"


def test_unknown_command_is_a_usage_error() -> None:
    result = corral("frobnicate")
    assert result.returncode == 2
    assert "invalid choice" in result.stderr


def test_a_bad_config_is_named_with_the_fix(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "corral.toml").write_text("[sandbox]\ntier_minimum = 'T2'\n")
    result = corral("up", home=home)
    assert result.returncode == 2
    assert "tier_minimum" in result.stderr
    assert "allowed" in result.stderr
