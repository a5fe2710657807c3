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
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeAlias

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


def add_home(p: argparse.ArgumentParser) -> None:
    p.add_argument("--home", type=Path, default=default_home(),
                   help="the farm's home directory (default: $CORRAL_HOME or ~/.corral)")


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")


def workers_arg(text: str) -> int:
    """``--workers``: a whole number of local sandbox workers, 0 to 256."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 0 <= n <= 256:
        raise argparse.ArgumentTypeError("must be between 0 (remote workers only) and 256")
    return n
