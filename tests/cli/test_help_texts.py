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
