"""The ``corral`` argument parser: the root parser, and every command group's
sub-parsers in the order ``corral --help`` lists them.

Each command group module (``lifecycle``, ``run``, ``control``, ``sessions``,
``checkpoints``, ``images``, ``storecmd``, ``remote``, ``completion``, ``dev``) declares its own
sub-parsers in ``add_parsers`` and binds each one to its handler with
``set_defaults(handler=...)``; ``app.main`` calls ``ns.handler(ns)``. Adding a
command touches its group module only (a new group adds one line here).

Invariant: building the parser imports the command modules and nothing heavy
(no farm, store, engine or client module, no dev tooling): ``corral --help``
and ``corral completion`` stay fast (pinned by tests/architecture).
"""

from __future__ import annotations

import argparse

from supervisor.cli import (
    checkpoints,
    completion,
    control,
    dev,
    images,
    lifecycle,
    remote,
    run,
    sessions,
    storecmd,
)
from supervisor.cli.common import VERSION, CorralParser, Subparsers


def build_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = CorralParser(
        prog="corral",
        description="Corral: LLM agent sessions with sandboxed tools that survive crashes.",
        epilog="Start with 'corral run --workspace DIR \"PROMPT\"' (a first run writes "
               "HOME/corral.toml; 'corral init' does only that), or keep a farm up with "
               "'corral up --detach'. 'corral COMMAND --help' explains each command.")
    parser.add_argument("--version", action="version", version=f"corral {VERSION}",
                        help="print the version and exit")
    parser.add_argument("--log-level", default="WARNING", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                        metavar="LEVEL", help="log level on stderr: debug, info, warning, "
                        "error or critical (default: warning)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    lifecycle.add_parsers(sub)      # init, up, down, status
    run.add_parsers(sub)            # run
    control.add_parsers(sub)        # approve, interrupt
    sessions.add_parsers(sub)       # sessions, show, terminate, delete
    checkpoints.add_parsers(sub)    # export, verify, import
    images.add_parsers(sub)         # image import|ls|rm
    storecmd.add_parsers(sub)       # store migrate
    dev.add_fake_llm_parser(sub)    # fake-llm
    remote.add_parsers(sub)         # keys, worker
    completion.add_parsers(sub, parser)  # completion
    dev.add_chaos_parser(sub)       # chaos
    _describe(sub)
    _examples(sub)
    return parser


EXAMPLES: dict[str, tuple[str, ...]] = {
    "init": ("corral init                       # ~/.corral/corral.toml, a working route",),
    "up": ("corral up --detach                # start the farm in the background",
           "corral up --detach --workers 4 --web 127.0.0.1:8765",
           "corral up                         # in the foreground; Ctrl-C stops it"),
    "down": ("corral down                       # stop the farm of ~/.corral",),
    "status": ("corral status --json | jq .farm.children",),
    "run": ('corral run --workspace ./proj "list the files"',
            'corral run --session SID "now fix the test"     # continue a session',
            "corral run --session SID                      # attach: follow, answer",
            "corral run --workspace ./proj - < task.md     # the prompt from stdin",
            'corral run --approval allow --json "..." | jq -c .type',
            'corral run --model openai-chat:qwen2.5 --base-url http://127.0.0.1:8000/v1 "hi"'),
    "approve": ("corral approve SID APPROVAL_ID --decision approved",),
    "interrupt": ("corral interrupt SID",),
    "sessions": ("corral sessions --state waiting_for_approval",
                 "corral sessions --since 2h --json"),
    "show": ("corral show SID", "corral show SID --json | jq -c .type"),
    "terminate": ("corral terminate SID",),
    "delete": ("corral delete SID --yes",),
    "export": ("corral export SID --out sid.json && corral verify sid.json",),
    "verify": ("corral verify sid.json",),
    "import": ("corral import sid.json --workspace ./proj   # with the farm stopped",),
    "image import": ("corral image import py.tar --name tools/py:3.11 --allow-setuid",),
    "image ls": ("corral image ls --json",),
    "image rm": ("corral image rm tools/py:3.11",),
    "completion": ('eval "$(corral completion bash)"     # in ~/.bashrc',),
}


def _examples(sub: Subparsers, prefix: str = "") -> None:
    for name, command in sub.choices.items():
        lines = EXAMPLES.get(f"{prefix}{name}")
        if lines and isinstance(command, CorralParser):
            command.examples = lines
        for action in command._actions:
            if isinstance(action, argparse._SubParsersAction):
                _examples(action, f"{prefix}{name} ")


def _describe(sub: Subparsers) -> None:
    """Every command (and sub-command) explains itself in its own --help: its
    one-line summary when it has no longer description."""
    for name, command in sub.choices.items():
        if not command.description:
            command.description = next((a.help for a in sub._choices_actions
                                        if a.dest == name), None)
        for action in command._actions:
            if isinstance(action, argparse._SubParsersAction):
                _describe(action)
