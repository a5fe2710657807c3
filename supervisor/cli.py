"""The ``corral`` command line: one parser, one small module per command group.

Every command has ``--help``; long work shows progress; ``--json`` gives one
JSON document (or one JSON event per line for streams) for scripts; errors
say what to do next and exit non-zero. Exit codes: 0 ok, 1 the work failed
(a turn aborted, a check failed), 2 usage or configuration error, 3 the farm
is unavailable, 4 a tool call waits for an approval nobody here can give
(``corral run`` without a terminal), 130 interrupted with Ctrl-C. A closed
stdout (``corral ... | head``) ends the command quietly with 141, as SIGPIPE
does for other CLIs.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path

from broker.plants import PLANTS
from supervisor import __version__

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
EXIT_NEEDS_APPROVAL = 4
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141
VERSION = __version__
SESSION_STATES = ("running", "waiting_for_approval", "idle", "failed", "terminated",
                  "suspended")


def default_home() -> Path:
    return Path(os.environ.get("CORRAL_HOME", Path.home() / ".corral"))


def _home(p: argparse.ArgumentParser) -> None:
    p.add_argument("--home", type=Path, default=default_home(),
                   help="the farm's home directory (default: $CORRAL_HOME or ~/.corral)")


def _json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _workers(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 0 <= n <= 256:
        raise argparse.ArgumentTypeError("must be between 0 (remote workers only) and 256")
    return n


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="corral",
        description="Corral: LLM agent sessions with sandboxed tools that survive crashes.",
        epilog="Start with 'corral run --workspace DIR \"PROMPT\"' (a first run writes "
               "HOME/corral.toml; 'corral init' does only that), or keep a farm up with "
               "'corral up --detach'. 'corral COMMAND --help' explains each command.")
    parser.add_argument("--version", action="version", version=f"corral {VERSION}",
                        help="print the version and exit")
    parser.add_argument("--log-level", default="WARNING", help="log level (default: WARNING)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("init", help="write a commented corral.toml with a working model route",
                       description="Write HOME/corral.toml (commented) unless it exists. Its "
                       "[routes.main] uses a provider whose key is in the environment "
                       "(ANTHROPIC_API_KEY, OPENAI_API_KEY), else the scripted demo model. "
                       "The first 'corral up' or 'corral run' does the same.")
    _home(p)
    _json(p)

    p = sub.add_parser("up", help="start a farm (broker, supervisor, sandbox workers)",
                       description="Start a farm. In the foreground it supervises its "
                       "children until Ctrl-C; with --detach it returns once the farm serves "
                       "and writes HOME/farm.json.")
    _home(p)
    p.add_argument("--workers", type=_workers, default=None,
                   help="sandbox workers (default: config, else one per core, at least 2; "
                   "0: none here, every worker is remote)")
    p.add_argument("--detach", action="store_true", help="run in the background")
    _json(p)

    p = sub.add_parser("down", help="stop the farm gracefully",
                       description="Stop a detached farm: sessions checkpointed, workers "
                       "drained, no process left behind. With no farm running it does "
                       "nothing and succeeds.")
    _home(p)
    _json(p)

    p = sub.add_parser("status", help="show processes, workers, sessions and queues",
                       description="Show the running farm: its processes and restarts, "
                       "the workers of each service and host, queues and session counts.")
    _home(p)
    _json(p)

    p = sub.add_parser("run", help="submit one user turn and stream its events",
                       description="Submit PROMPT as one user turn and stream the events. "
                       "Without a running farm at HOME a temporary one runs for the run "
                       "(reachable by approve, interrupt, show and sessions while it lives); "
                       "its store stays in HOME so --session ID continues later. With "
                       "--session and no PROMPT it attaches to the session's running turn "
                       "and asks for its pending approval. Ctrl-C interrupts the turn "
                       "(a second Ctrl-C leaves at once). Exits 0 on turn_complete, 1 on "
                       "abort or failure, 4 when an approval is needed and there is no "
                       "terminal to ask, 130 after Ctrl-C.")
    _home(p)
    p.add_argument("prompt", nargs="?", default=None,
                   help="the user's message (optional with --session: attach)")
    p.add_argument("--session", default=None, help="continue this session")
    p.add_argument("--model", default=None,
                   help="route name from corral.toml, PROVIDER:MODEL (openai-responses, "
                   "openai-chat, anthropic) or script:PATH")
    p.add_argument("--base-url", default=None, help="base URL for a PROVIDER:MODEL route")
    p.add_argument("--workspace", type=Path, default=None,
                   help="the directory tools work in (default: the current directory)")
    p.add_argument("--approval", default=None, choices=["ask", "allow", "deny"],
                   help="approval policy for tool calls (default: from corral.toml)")
    p.add_argument("--sandbox", default=None, choices=["read-only", "workspace-write"],
                   help="a new session's sandbox mode: read-only binds the workspace "
                   "read-only (default: workspace-write; network is a separate grant)")
    p.add_argument("--allow-git-write", action="store_true",
                   help="a new session's tools may write .git in the workspace (its config "
                   "and hooks run on the host; read-only by default); recorded")
    p.add_argument("--workers", type=_workers, default=None,
                   help="workers of a temporary farm (default 2)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="give up after this long")
    _json(p)

    p = sub.add_parser("approve", help="answer a pending approval request",
                       description="Answer the approval request ID that session SESSION "
                       "waits on. An id that is not pending (stale, mistyped, already "
                       "answered) is refused with exit 1.")
    _home(p)
    p.add_argument("session", help="the session id (see 'corral sessions')")
    p.add_argument("id", help="the approval request id (from exec_approval_request)")
    p.add_argument("--decision", required=True,
                   choices=["approved", "approved_for_session", "denied", "abort"],
                   help="approved: run the calls once; approved_for_session: also these "
                   "exact calls later; denied: answer them with an error; abort: end the turn")
    _json(p)

    p = sub.add_parser("interrupt", help="interrupt a session's active turn",
                       description="Interrupt the session's running turn: its tools are "
                       "cancelled and it ends as 'interrupted'; the session stays usable.")
    _home(p)
    p.add_argument("session", help="the session id (see 'corral sessions')")
    _json(p)

    p = sub.add_parser("sessions", help="list sessions with their state, times and turns",
                       description="List the sessions of the farm at HOME, most recently "
                       "active first, with created and last-active times, state, turns, "
                       "route and workspace. Reads the store read-only, so it works with "
                       "the farm stopped (a turn left running then shows as 'suspended': "
                       "it resumes when a farm starts).")
    _home(p)
    p.add_argument("--state", action="append", choices=SESSION_STATES, default=None,
                   help="only sessions in this state (repeat for several)")
    p.add_argument("--since", default=None,
                   help="only sessions active since then: a duration (90s, 30m, 2h, 7d) or "
                   "a date (2026-12-01 or 2026-12-01T10:00)")
    p.add_argument("--limit", type=int, default=100,
                   help="list at most this many (default 100, at most 1000)")
    _json(p)

    p = sub.add_parser("show", help="show a session's history, replayed from the store",
                       description="Replay a session's recorded events. Works with the "
                       "farm stopped (reads the store read-only).")
    _home(p)
    p.add_argument("session", help="the session id (see 'corral sessions')")
    _json(p)

    p = sub.add_parser("terminate", help="end a session: abort its turn, refuse new ones",
                       description="Terminate a session: its running turn is aborted (tools "
                       "cancelled) and it accepts no further input, also after restarts. "
                       "Its history stays ('corral show'); 'corral delete' removes it.")
    _home(p)
    p.add_argument("session", help="the session id (see 'corral sessions')")
    _json(p)

    p = sub.add_parser("delete", help="remove a session and its history from the store",
                       description="Delete a stored session (terminating it first if it "
                       "runs). Asks for confirmation at a terminal; --yes skips that (needed "
                       "without a terminal). Files it made in its workspace stay.")
    _home(p)
    p.add_argument("session", help="the session id (see 'corral sessions')")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    _json(p)

    p = sub.add_parser("export", help="write a session's latest portable checkpoint",
                       description="Write the session's latest checkpoint (made at each "
                       "tool boundary) to --out; 'corral verify' checks it and 'corral "
                       "import' resumes it in another farm.")
    _home(p)
    p.add_argument("session", help="the session id (see 'corral sessions')")
    p.add_argument("--out", type=Path, required=True, help="the file to write")
    _json(p)

    p = sub.add_parser("verify", help="check a checkpoint file's digests and consistency",
                       description="Exits 0 when the checkpoint verifies, 1 on any tampering "
                       "or inconsistency (each problem is listed).")
    p.add_argument("file", type=Path, help="a checkpoint written by 'corral export'")
    _json(p)

    p = sub.add_parser("import", help="resume an exported session in this farm's store",
                       description="Import a checkpoint from 'corral export' into the store "
                       "of the (stopped) farm at HOME; the session continues with 'corral "
                       "run --session ID'.")
    _home(p)
    p.add_argument("file", type=Path, help="a checkpoint written by 'corral export'")
    p.add_argument("--session", default=None, help="the new session id (default: same)")
    p.add_argument("--workspace", type=Path, default=None,
                   help="the imported session's workspace (default: the current directory)")
    p.add_argument("--model", default=None,
                   help="route name from corral.toml (default: the configured default route)")
    p.add_argument("--approval", default=None, choices=["ask", "allow", "deny"],
                   help="the approval policy the session ran with, when it was not the "
                   "corral.toml default (it is part of the checkpoint's capability binding)")
    _json(p)

    p = sub.add_parser("fake-llm", help="run the scripted provider (a real HTTP server)",
                       description="Serve a script of model responses in the OpenAI "
                       "Responses, Chat Completions and Anthropic Messages wire formats. "
                       "Prints its URL.")
    p.add_argument("--script", type=Path, required=True,
                   help='the script: {"responses": [...]} (docs/models.md, "The scripted '
                   'provider")')
    p.add_argument("--port", type=int, default=0, help="port to listen on (0: any free one)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")

    _remote_commands(sub)

    p = sub.add_parser("completion", help="print a shell completion script (bash or zsh)",
                       description="Print a completion script. bash: eval \"$(corral "
                       "completion bash)\" in ~/.bashrc; zsh: eval \"$(corral completion "
                       "zsh)\" in ~/.zshrc.")
    p.add_argument("shell", choices=["bash", "zsh"], help="the shell")

    p = sub.add_parser("chaos", help="run a farm under injected faults and check invariants",
                       description="Start a private farm, run scripted sessions through it "
                       "while injecting faults on a seeded schedule, then check every "
                       "invariant (docs/chaos.md). Exits 1 if any is violated.")
    _home(p)
    p.add_argument("--seed", type=int, default=1,
                   help="seed of the fault schedule; the same seed gives the same schedule")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of faults")
    p.add_argument("--sessions", type=int, default=8, help="sessions to run (default 8)")
    p.add_argument("--faults", default="all",
                   help="comma list of fault kinds or groups (process, window, cancel, "
                   "frame, provider, store), or 'all' (default); e.g. "
                   "worker_kill_tool,crash_publish")
    p.add_argument("--workers", type=int, default=3, help="sandbox workers (default 3)")
    p.add_argument("--fault-gap", type=float, default=2.5, metavar="S",
                   help="minimum seconds between timed faults (gaps are S to 2S; default "
                   "2.5): every enabled kind is reached within 2 + 2*S*(kinds-1) s")
    p.add_argument("--frame-rate", type=float, default=0.02, metavar="R",
                   help="share of request-traffic frames the broker drops, delays or "
                   "duplicates (0-0.5, default 0.02)")
    p.add_argument("--provider-rate", type=float, default=0.15, metavar="R",
                   help="share of the script's model answers whose first attempt fails "
                   "(429, 500, hang, cut; default 0.15)")
    p.add_argument("--plant", action="append", default=[], choices=sorted(PLANTS),
                   metavar="NAME",
                   help="switch on a planted bug in the farm's processes, to see the "
                   "checker catch it (repeatable): " + "; ".join(
                       f"{name}: {what}" for name, what in sorted(PLANTS.items())))
    _json(p)
    _describe(sub)
    return parser


def _describe(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Every command (and sub-command) explains itself in its own --help: its
    one-line summary when it has no longer description."""
    for name, command in sub.choices.items():
        if not command.description:
            command.description = next((a.help for a in sub._choices_actions
                                        if a.dest == name), None)
        for action in command._actions:
            if isinstance(action, argparse._SubParsersAction):
                _describe(action)


def _remote_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``corral keys`` and ``corral worker`` (implemented in ``cli_remote.py``)."""
    p = sub.add_parser("keys", help="CURVE keys and the allow-list of a farm",
                       description="Key management for farms across hosts: see "
                       "docs/multihost.md.")
    keys = p.add_subparsers(dest="keys_command", metavar="KEYS_COMMAND", required=True)
    k = keys.add_parser("init", help="write the farm's broker and supervisor key pairs")
    _home(k)
    _json(k)
    k = keys.add_parser("new", help="write a key pair NAME.key and NAME.key_secret (0600)")
    k.add_argument("name", help="the key's name: writes NAME.key and NAME.key_secret")
    k.add_argument("--dir", type=Path, default=Path("."), help="where (default: here)")
    _json(k)
    k = keys.add_parser("allow", help="put a public key on the farm's allow-list",
                        description="Copies the public key of FILE into HOME/keys/allowed; "
                        "the running broker and supervisor pick it up without a restart.")
    _home(k)
    k.add_argument("file", type=Path, help="a NAME.key file")
    k.add_argument("--tenant", default=None, help="bind a client key to this tenant")
    k.add_argument("--role", default=None, choices=["worker", "client", "supervisor"],
                   help="what the key may do (default: client with --tenant, else worker)")
    k.add_argument("--name", default=None, help="name on the allow-list (default: file stem)")
    _json(k)

    p = sub.add_parser("worker", help="run sandbox workers for a farm on another host",
                       description="Become a sandbox worker process serving a remote "
                       "broker over CURVE; reconnects forever, drains on SIGTERM.")
    p.add_argument("--broker", required=True, help="the broker's backend, tcp://HOST:PORT")
    p.add_argument("--server-key", type=Path, default=None, help="the broker's public key")
    p.add_argument("--key", type=Path, default=None, help="this worker's NAME.key_secret")
    p.add_argument("--services", default="tool,model", help="default: tool,model")
    p.add_argument("--tier-min", default=None, help="lowest sandbox tier to accept, e.g. T2")
    p.add_argument("--capacity", type=int, default=4, help="requests at once (default 4)")
    p.add_argument("--drain-s", type=float, default=5.0, help="drain time on SIGTERM")
    p.add_argument("--heartbeat-interval-s", type=float, default=None,
                   help="seconds between heartbeats (default: the worker's, 0.25)")
    p.add_argument("--liveness", type=int, default=None,
                   help="missed heartbeats before the broker is taken as gone "
                   "(default: the worker's, 4)")
    p.add_argument("--worker-log-level", default="INFO",
                   help="log level of the worker processes (default INFO)")


def _stdout_closed() -> int:
    """The reader of our stdout went away (``| head``): stop quietly, as CLIs do.
    Later writes (and the interpreter's final flush) go to /dev/null."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return EXIT_BROKEN_PIPE


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from supervisor import cli_commands

    handler = getattr(cli_commands, "cmd_" + ns.command.replace("-", "_"))
    try:
        code: int = handler(ns)
        sys.stdout.flush()
    except KeyboardInterrupt:
        print("corral: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return _stdout_closed()
    return code


if __name__ == "__main__":
    sys.exit(main())
