"""The farm's root process: ``python -m supervisor.farm --home DIR`` (what
``corral up`` runs). Supervises broker, workers and supervisor until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from supervisor.config import ConfigError
from supervisor.farm.root import Farm, serve_forever


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m supervisor.farm",
        description="Run a Corral farm in the foreground: broker, sandbox workers and "
        "supervisor, restarted when they crash. Stops gracefully on SIGTERM.")
    parser.add_argument("--home", type=Path, required=True, help="the farm's home directory")
    parser.add_argument("--workers", type=int, default=None,
                        help="sandbox worker processes (default: config, else one per core)")
    parser.add_argument("--brokers", type=int, default=None, choices=range(1, 5),
                        metavar="N", help="broker processes, 1..4 (default: [farm] brokers, 1)")
    parser.add_argument("--supervisors", type=int, default=None, choices=range(1, 9),
                        metavar="N", help="supervisor processes, 1..8, sharing the sessions "
                        "(default: [farm] supervisors, 1); more than 1 needs [store] url")
    parser.add_argument("--metrics", default=None, metavar="HOST:PORT",
                        help="serve Prometheus /metrics (default: [telemetry] metrics_listen)")
    parser.add_argument("--web", default=None, metavar="HOST:PORT",
                        help="serve the read-only live web view (default: [web] listen)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--broker-faults", default=None, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    try:
        farm = Farm(ns.home, workers=ns.workers, brokers=ns.brokers, supervisors=ns.supervisors,
                    log_level=ns.log_level,
                    broker_faults=ns.broker_faults, metrics=ns.metrics, web=ns.web)
    except ConfigError as exc:
        print(f"corral: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(serve_forever(farm))


if __name__ == "__main__":
    sys.exit(main())
