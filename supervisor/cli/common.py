"""What every ``corral`` command module shares: exit codes, the handler type and
the options most commands take (``--home``, ``--json``, ``--workers``).

A leaf of the CLI package: the standard library and ``supervisor.__version__``
only, so any command module may import it without a circle.

Exit codes: 0 ok, 1 the work failed (a turn aborted, a check failed), 2 usage
or configuration error, 3 the farm is unavailable, 4 a tool call waits for an
approval nobody here can give (``corral run`` without a terminal), 130
interrupted with Ctrl-C, 141 stdout closed (``corral ... | head``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeAlias

from supervisor import __version__

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
EXIT_NEEDS_APPROVAL = 4
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141
VERSION = __version__

Handler: TypeAlias = Callable[[argparse.Namespace], int]
"""A command: takes the parsed arguments, returns the process exit code. Each
sub-parser is bound to its own with ``set_defaults(handler=...)``."""

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def default_home() -> Path:
    return Path(os.environ.get("CORRAL_HOME", Path.home() / ".corral"))


def home_arg(text: str) -> Path:
    """``--home`` (and ``$CORRAL_HOME``): a directory, made when missing; refused at
    once when it, or a directory above it, is a file (every command then failed in
    its own words: "File exists", "cannot be read (Not a directory); check its
    permissions", a traceback from ``run``)."""
    home = Path(text).expanduser()
    for path in (home, *home.parents):
        if path.exists() or path.is_symlink():
            if not path.is_dir():
                what = "is a file" if path == home else f"is under {path}, a file"
                raise argparse.ArgumentTypeError(
                    f"{home} {what}; give a directory (it is made when missing)")
            break
    return home


def add_home(p: argparse.ArgumentParser) -> None:
    p.add_argument("--home", type=home_arg, default=str(default_home()),
                   help="the farm's home directory, made when missing (default: "
                   "$CORRAL_HOME or ~/.corral)")


class CorralParser(argparse.ArgumentParser):
    """The parser of ``corral`` and of each of its commands: with ``--json`` among the
    arguments a usage error is also a JSON document on stdout, ``{"ok": false,
    "error": {"kind": "usage", "message": ...}}``, so a script reads every failure
    the same way (exit 2 either way; the usage text stays on stderr)."""

    json_errors = False  # set by ``json_errors_for`` before parsing
    examples: tuple[str, ...] = ()  # "COMMAND LINE  # what it does", shown as written

    def format_help(self) -> str:
        text = super().format_help()
        if not self.examples:
            return text
        return text + "\nexamples:\n" + "".join(f"  {line}\n" for line in self.examples)

    def error(self, message: str) -> NoReturn:
        if self.json_errors:
            sys.stdout.write(json.dumps({"ok": False, "error": {
                "kind": "usage", "message": f"{self.prog}: {message}"}}, sort_keys=True)
                + "\n")
            sys.stdout.flush()
        super().error(message)


def json_errors_for(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Make ``parser`` and its sub-parsers answer usage errors in JSON when ``argv``
    asks for ``--json``."""
    wanted = "--json" in argv
    todo = [parser]
    while todo:
        p = todo.pop()
        if isinstance(p, CorralParser):
            p.json_errors = wanted
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")


def bounded(kind: type[int] | type[float], low: float, high: float | None = None, *,
            above: bool = False) -> Callable[[str], Any]:
    """An option's type: a whole number (``int``) or a number (``float``) from ``low``
    (or ``above`` it) to ``high``; argparse turns the refusal into a usage error that
    names the option (``corral chaos --duration -5`` ran a chaos run of -5 s)."""
    words = "a whole number" if kind is int else "a number"
    bound = (f"above {low:g}" if above else f"at least {low:g}") + (
        f" and at most {high:g}" if high is not None else "")

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {words}") from None
        if (value <= low if above else value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def workers_arg(text: str) -> int:
    """``--workers``: a whole number of local sandbox workers, 0 to 256."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 0 <= n <= 256:
        raise argparse.ArgumentTypeError("must be between 0 (remote workers only) and 256")
    return n
