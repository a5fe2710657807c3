"""Every option and argument of every ``corral`` command says what it is for."""

from __future__ import annotations

import argparse

from supervisor.cli import build_parser


def _undocumented(parser: argparse.ArgumentParser, path: str) -> list[str]:
    missing: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                missing += _undocumented(sub, f"{path} {name}")
        elif action.help is None and action.dest != "help":
            missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    return missing


def test_every_option_of_every_command_has_help() -> None:
    assert _undocumented(build_parser(), "corral") == []


def test_every_option_of_the_process_entry_points_has_help() -> None:
    """``python -m supervisor`` (how a supervisor joins a farm from another host) and
    ``python -m sandbox_worker`` (what ``corral worker`` runs)."""
    from sandbox_worker.main import build_parser as worker_parser
    from supervisor.main import build_parser as supervisor_parser

    assert _undocumented(supervisor_parser(), "python -m supervisor") == []
    assert _undocumented(worker_parser(), "python -m sandbox_worker") == []


def test_every_example_in_the_help_parses() -> None:
    """The examples at the end of ``corral COMMAND --help`` are command lines the
    parser accepts (the part before a pipe, redirection or comment)."""
    import re
    import shlex

    from supervisor.cli.common import CorralParser

    parser = build_parser()
    shown: list[str] = []

    def collect(p: argparse.ArgumentParser) -> None:
        if isinstance(p, CorralParser):
            shown.extend(p.examples)
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    collect(sub)

    collect(parser)
    assert len(shown) >= 20
    for line in shown:
        command = re.search(r"corral [^|<#)&]*", line)
        assert command is not None, line
        argv = shlex.split(command.group(0))[1:]
        parsed = parser.parse_args(argv)
        assert parsed.handler is not None, line
    assert "examples:" in parser._subparsers._group_actions[0].choices["run"].format_help()
