"""``corral``'s ``main``: parse, configure logging, run the chosen command.

The only place in the CLI that configures logging. Dispatch is explicit: each
sub-parser carries its handler (``set_defaults(handler=...)``, see
``parser.py``), and ``main`` calls it with the parsed arguments.

Invariants: Ctrl-C ends a command with 130 and one line on stderr; a closed
stdout (``corral ... | head``) ends it quietly with 141, as SIGPIPE does for
other CLIs; every other outcome is the handler's own exit code.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

from supervisor.cli.common import (
    EXIT_BROKEN_PIPE,
    EXIT_INTERRUPTED,
    Handler,
    json_errors_for,
)
from supervisor.cli.parser import build_parser


def _stdout_closed() -> int:
    """The reader of our stdout went away (``| head``): stop quietly, as CLIs do.
    Later writes (and the interpreter's final flush) go to /dev/null."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return EXIT_BROKEN_PIPE


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    json_errors_for(parser, sys.argv[1:] if argv is None else argv)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler: Handler = ns.handler
    try:
        code = handler(ns)
        sys.stdout.flush()
    except KeyboardInterrupt:
        print("corral: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return _stdout_closed()
    return code
