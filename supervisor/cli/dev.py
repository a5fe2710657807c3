"""``corral fake-llm`` and ``corral chaos``: the dev and test tooling the CLI
starts.

- ``fake-llm`` becomes the scripted provider (``exec`` of ``python -m
  sandbox_worker.fakellm``), so ``kill PID`` reaches the server itself.
- ``chaos`` runs ``supervisor.chaos`` (docs/chaos.md).

Invariant: the chaos harness is imported by ``cmd_chaos`` only, when the
command runs; building the parser loads no dev tooling (only the names of the
planted bugs, ``broker.plants``, for ``--plant``'s choices), and no production
process imports this module's targets (pinned by tests/architecture).
"""

from __future__ import annotations

import os
import sys
from argparse import Namespace
from pathlib import Path

from broker.plants import PLANTS
from supervisor.cli.common import Subparsers, add_home, add_json, bounded


def add_fake_llm_parser(sub: Subparsers) -> None:
    p = sub.add_parser("fake-llm", help="run the scripted provider (a real HTTP server)",
                       description="Serve a script of model responses in the OpenAI "
                       "Responses, Chat Completions and Anthropic Messages wire formats. "
                       "Prints its URL.")
    p.add_argument("--script", type=Path, required=True,
                   help='the script: {"responses": [...]} (docs/models.md, "The scripted '
                   'provider")')
    p.add_argument("--port", type=bounded(int, 0, 65535), default=0,
                   help="port to listen on (0: any free one)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.set_defaults(handler=cmd_fake_llm)


def add_chaos_parser(sub: Subparsers) -> None:
    p = sub.add_parser("chaos", help="run a farm under injected faults and check invariants",
                       description="Start a private farm, run scripted sessions through it "
                       "while injecting faults on a seeded schedule, then check every "
                       "invariant (docs/chaos.md). Exits 1 if any is violated.")
    add_home(p)
    p.add_argument("--seed", type=int, default=1,
                   help="seed of the fault schedule; the same seed gives the same schedule")
    p.add_argument("--duration", type=bounded(float, 0, above=True), default=60.0,
                   help="seconds of faults (default 60)")
    p.add_argument("--sessions", type=bounded(int, 1, 1000), default=8,
                   help="sessions to run (default 8)")
    p.add_argument("--faults", default="all",
                   help="comma list of fault kinds or groups (process, window, cancel, "
                   "frame, provider, store, brokers, supervisors), or 'all' (default: "
                   "every kind the farm's shape allows); e.g. worker_kill_tool,crash_publish."
                   " Naming broker_kill_one (group brokers) runs the farm with two brokers, "
                   "supervisor_stop or pg_restart (group supervisors) with three supervisors "
                   "on PostgreSQL")
    p.add_argument("--workers", type=bounded(int, 1, 256), default=3,
                   help="sandbox workers (default 3)")
    p.add_argument("--fault-gap", type=bounded(float, 0, above=True), default=2.5, metavar="S",
                   help="minimum seconds between timed faults (gaps are S to 2S; default "
                   "2.5): every enabled kind is reached within 2 + 2*S*(kinds-1) s")
    p.add_argument("--frame-rate", type=bounded(float, 0, 0.5), default=0.02, metavar="R",
                   help="share of request-traffic frames the broker drops, delays or "
                   "duplicates (0-0.5, default 0.02)")
    p.add_argument("--provider-rate", type=bounded(float, 0, 1), default=0.15, metavar="R",
                   help="share of the script's model answers whose first attempt fails "
                   "(429, 500, hang, cut; default 0.15)")
    p.add_argument("--plant", action="append", default=[], choices=sorted(PLANTS),
                   metavar="NAME",
                   help="switch on a planted bug in the farm's processes, to see the "
                   "checker catch it (repeatable): " + "; ".join(
                       f"{name}: {what}" for name, what in sorted(PLANTS.items())))
    p.add_argument("--metrics", default=None, metavar="HOST:PORT",
                   help="serve the farm's Prometheus /metrics there during the run (port 0: "
                   "any; the URL is printed on stderr), with corral_chaos_faults_injected_"
                   "total by kind")
    p.add_argument("--supervisors", type=bounded(int, 1, 8), default=None, metavar="N",
                   help="supervisors sharing the sessions on PostgreSQL (default 1 on "
                   "SQLite; 3 when a supervisor-set fault is named: supervisor_stop, "
                   "pg_restart); 2 or more run on --store-url or a throwaway cluster")
    p.add_argument("--brokers", type=bounded(int, 1, 4), default=None, metavar="N",
                   help="brokers (default 1; 2 when broker_kill_one is named)")
    p.add_argument("--store-url", default=None, metavar="URL",
                   help="an empty PostgreSQL database for a farm of several supervisors "
                   "(default: a throwaway cluster the run starts and stops; pg_restart "
                   "needs that one)")
    add_json(p)
    p.set_defaults(handler=cmd_chaos)


def cmd_fake_llm(ns: Namespace) -> int:
    """Become the scripted provider (exec): ``kill PID`` then reaches the server
    itself, and nothing is left behind."""
    argv = [sys.executable, "-m", "sandbox_worker.fakellm", "--script", str(ns.script),
            "--port", str(ns.port), "--host", ns.host]
    env = {k: v for k, v in os.environ.items() if k != "CORRAL_PARENT_PID"}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, env)  # never returns


def cmd_chaos(ns: Namespace) -> int:
    from supervisor.chaos import main as chaos_main

    return chaos_main(ns)
