"""The built-in ``echo`` service: for tests, the benchmark and the foundation demo.

The handler returns the request body unchanged. If the body is a msgpack map,
these optional fields change its behaviour (applied in this order):

- ``"tag": str``           names the request in ``--events`` output
- ``"sleep_s": float``     sleep first (bounded by the request's remaining budget)
- ``"partials": int``      stream that many PARTIALs (``{"i": n}`` msgpack), 0..10000
- ``"fail": str``          answer FAILURE with this kind (``"retryable": bool``, default
                           false; ``"message": str``)
- ``"crash": true``        raise an unexpected exception (→ FAILURE internal)

Run a worker process: ``python -m broker.echo --backend EP [--capacity N]``. It
prints one JSON readiness line ``{"event": "ready", "pid", "identity"}`` once
the broker acknowledges it; with ``--events`` it also prints ``start``,
``cancelled`` and ``done`` events (with the request's ``tag``) so tests can
observe what reached the worker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any, Final

from broker import protocol
from broker.errors import HandlerError
from broker.worker import BrokerWorker, Handler, RequestContext

SERVICE: Final = "echo"
MAX_PARTIALS: Final = 10_000


_OPTION_KEYS: Final = frozenset({"tag", "sleep_s", "partials", "fail", "crash"})


def _options(body: bytes) -> dict[str, Any]:
    """The option fields of a msgpack-map body; empty for anything else."""
    if not body or not (0x80 <= body[0] <= 0x8F or body[0] in (0xDE, 0xDF)):
        return {}
    try:
        data = protocol.unpack(body)
    except protocol.ProtocolError:
        return {}
    if not isinstance(data, dict) or _OPTION_KEYS.isdisjoint(data):
        return {}
    return data


def make_echo_handler(on_event: Callable[[str, str], None] | None = None) -> Handler:
    """The echo handler; ``on_event(event, tag)`` observes start/cancelled/done."""

    def emit(event: str, tag: str) -> None:
        if on_event is not None:
            on_event(event, tag)

    async def echo(ctx: RequestContext) -> bytes:
        opts = _options(ctx.body)
        if not opts:
            return ctx.body
        tag = str(opts.get("tag", ""))
        emit("start", tag)
        try:
            sleep_s = opts.get("sleep_s")
            if isinstance(sleep_s, int | float) and sleep_s > 0:
                await asyncio.sleep(min(float(sleep_s), ctx.budget_s() + 5.0))
            partials = opts.get("partials")
            if isinstance(partials, int) and partials > 0:
                for i in range(min(partials, MAX_PARTIALS)):
                    await ctx.send_partial(protocol.pack({"i": i}))
            if opts.get("crash") is True:
                raise RuntimeError("echo asked to crash")
            fail = opts.get("fail")
            if isinstance(fail, str) and fail:
                raise HandlerError(fail, str(opts.get("message", "echo asked to fail")),
                                   retryable=opts.get("retryable") is True)
        except asyncio.CancelledError:
            emit("cancelled", tag)
            raise
        emit("done", tag)
        return ctx.body

    return echo


def _print_json(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _amain(args: argparse.Namespace) -> None:
    on_event = None
    if args.events:
        def on_event(event: str, tag: str) -> None:
            _print_json({"event": event, "tag": tag})

    worker = BrokerWorker(
        args.backend, {SERVICE: make_echo_handler(on_event)}, capacity=args.capacity,
        info={"tier": "none", "role": "echo"}, heartbeat_interval_s=args.heartbeat_interval_s,
        liveness=args.liveness,
        identity=args.identity.encode() if args.identity else None,
    )

    def ready() -> None:
        _print_json({"event": "ready", "pid": os.getpid(),
                     "identity": worker.identity.decode()})

    loop = asyncio.get_running_loop()
    async with asyncio.TaskGroup() as tg:
        runner = tg.create_task(worker.run(on_ready=ready))

        def on_signal() -> None:
            tg.create_task(worker.stop(drain_s=args.drain_s))

        loop.add_signal_handler(signal.SIGTERM, on_signal)
        loop.add_signal_handler(signal.SIGINT, on_signal)
        await runner


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m broker.echo",
                                     description="Run an echo worker against a broker backend.")
    parser.add_argument("--backend", required=True, help="the broker's backend endpoint")
    parser.add_argument("--capacity", type=int, default=1, help="concurrent requests")
    parser.add_argument("--heartbeat-interval-s", type=float, default=0.25)
    parser.add_argument("--liveness", type=int, default=4)
    parser.add_argument("--identity", default="", help="stable worker identity (default: random)")
    parser.add_argument("--drain-s", type=float, default=5.0, help="drain time on SIGTERM")
    parser.add_argument("--events", action="store_true",
                        help="print start/cancelled/done JSON events on stdout")
    parser.add_argument("--log-level", default="WARNING",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_amain(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
