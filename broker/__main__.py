"""Entry point of the broker process: ``python -m broker --frontend EP --backend EP``.

Parses argv, configures logging (the only place in the package that does),
binds, prints one readiness JSON line on stdout, serves until SIGTERM/SIGINT,
then answers every open request (worker_lost, retryable), disconnects the
workers and exits 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType

from broker import otel, protocol
from broker.endpoints import bind_endpoint
from broker.faults import FrameFaults
from broker.lifeline import watch_parent
from broker.security import CurveServer, KeyFileError
from broker.server import Broker, BrokerConfig
from broker.state import Limits

_DEFAULTS = Limits()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m broker",
        description="Corral's ZeroMQ broker: reliable request-reply between clients "
        "(frontend) and workers (backend). Prints one JSON readiness line on stdout: "
        '{"event": "ready", "frontend", "backend", "pid", "broker_id"}.',
    )
    parser.add_argument("--frontend", required=True, type=bind_endpoint,
                        help="endpoint for clients, e.g. ipc:///tmp/f.sock or tcp://127.0.0.1:0")
    parser.add_argument("--backend", required=True, type=bind_endpoint,
                        help="endpoint for workers")
    parser.add_argument("--heartbeat-interval-s", type=float, default=0.25,
                        help="seconds between heartbeats (default 0.25)")
    parser.add_argument("--liveness", type=int, default=4,
                        help="missed heartbeats before a worker is declared dead (default 4)")
    parser.add_argument("--client-liveness", type=int, default=_DEFAULTS.client_liveness,
                        help="missed heartbeats before a client is declared gone and its "
                             "requests are cancelled (default 40: 10 s at 0.25 s; a false "
                             "expiry of a stalled client fails all its calls)")
    parser.add_argument("--max-message-bytes", type=int,
                        default=protocol.DEFAULT_MAX_MESSAGE_BYTES,
                        help="largest accepted message (default 16 MiB)")
    parser.add_argument("--queue-limit", type=int, default=_DEFAULTS.queue_limit,
                        help="queued requests per service before FAILURE overloaded")
    parser.add_argument("--max-workers", type=int, default=_DEFAULTS.max_workers)
    parser.add_argument("--max-clients", type=int, default=_DEFAULTS.max_clients)
    parser.add_argument("--max-requests", type=int, default=_DEFAULTS.max_requests,
                        help="requests tracked at once (queued + in flight)")
    parser.add_argument("--max-queued-bytes", type=int, default=_DEFAULTS.max_queued_bytes,
                        help="total size of queued request bodies (default 512 MiB)")
    parser.add_argument("--faults", default=None, metavar="SPEC",
                        help="chaos runs only: inject frame faults into request traffic, "
                        "e.g. 'frame_drop,frame_delay,frame_duplicate[:rate=0.02]'")
    parser.add_argument("--faults-seed", type=int, default=0,
                        help="seed of the fault injector (same seed, same decisions)")
    parser.add_argument("--curve-secret", type=Path, default=None, metavar="FILE",
                        help="the broker's CURVE key pair (NAME.key_secret): tcp:// endpoints "
                        "then require CURVE and an allowed client key (ipc:// stays plain)")
    parser.add_argument("--allow-dir", type=Path, default=None, metavar="DIR",
                        help="allow-list of public key files (re-read on change and SIGHUP)")
    parser.add_argument("--frontend-tcp", default=None, metavar="EP", type=bind_endpoint,
                        help="also bind this tcp:// endpoint, with CURVE, for clients "
                        "(besides a plain ipc:// --frontend; needs --curve-secret)")
    parser.add_argument("--backend-tcp", default=None, metavar="EP", type=bind_endpoint,
                        help="also bind this tcp:// endpoint, with CURVE, for workers")
    parser.add_argument("--log-level", default="WARNING",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args(argv)
    if (args.curve_secret is None) != (args.allow_dir is None):
        parser.error("--curve-secret and --allow-dir go together")
    for extra in (args.frontend_tcp, args.backend_tcp):
        if extra is not None and (args.curve_secret is None or not extra.startswith("tcp://")):
            parser.error("--frontend-tcp/--backend-tcp take tcp:// endpoints and need "
                         "--curve-secret and --allow-dir")
    args.curve = None
    if args.curve_secret is not None:
        try:
            args.curve = CurveServer.from_files(args.curve_secret, args.allow_dir)
        except KeyFileError as exc:
            parser.error(str(exc))
    try:
        args.faults = FrameFaults.parse(args.faults, seed=args.faults_seed)
    except ValueError as exc:
        parser.error(f"--faults: {exc}")
    if args.heartbeat_interval_s <= 0 or args.liveness < 1 or args.client_liveness < 1:
        parser.error("--heartbeat-interval-s must be > 0, --liveness and --client-liveness >= 1")
    if min(args.max_message_bytes, args.queue_limit, args.max_workers, args.max_clients,
           args.max_requests, args.max_queued_bytes) < 1:
        parser.error("limits must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    watch_parent()  # exit if the farm's root dies without stopping us
    limits = Limits(
        heartbeat_interval_s=args.heartbeat_interval_s, liveness=args.liveness,
        client_liveness=args.client_liveness, queue_limit=args.queue_limit,
        max_workers=args.max_workers,
        max_clients=args.max_clients, max_requests=args.max_requests,
        max_queued_bytes=args.max_queued_bytes,
    )
    broker = Broker(BrokerConfig(args.frontend, args.backend, limits, args.max_message_bytes,
                                 args.faults, curve=args.curve,
                                 frontend_tcp=args.frontend_tcp,
                                 backend_tcp=args.backend_tcp))
    if args.faults is not None:
        logging.getLogger("broker").warning("frame faults enabled: %s (rate %.3f, seed %d)",
                                            sorted(args.faults.kinds), args.faults.rate,
                                            args.faults_seed)
    provider = None
    if otel.wanted():  # OTEL_EXPORTER_OTLP_ENDPOINT (docs/operations.md)
        provider = otel.configure("corral-broker")
        broker.tracer = provider.get_tracer("corral.broker")
    frontend, backend = broker.bind()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        broker.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if broker.guard is not None:
        guard = broker.guard
        # Only sets a flag; the poll loop (never re-entered) does the reload.
        signal.signal(signal.SIGHUP, lambda signum, frame: guard.request_reload())
    ready = {"event": "ready", "frontend": frontend, "backend": backend,
             "pid": os.getpid(), "broker_id": broker.broker_id}
    if broker.tcp_endpoints:
        ready["tcp"] = broker.tcp_endpoints
    sys.stdout.write(json.dumps(ready) + "\n")
    sys.stdout.flush()
    try:
        broker.run()
    finally:
        broker.close()
        if provider is not None:
            otel.shutdown(provider)  # flushes the spans not exported yet, bounded
    return 0


if __name__ == "__main__":
    sys.exit(main())
