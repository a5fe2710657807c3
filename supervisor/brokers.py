"""The supervisor's link to its brokers: one ``BrokerClient``, or a ``BrokerSet``
when ``--broker`` is repeated (docs/multihost.md, "Several brokers").

Kept apart from ``supervisor/main.py`` so start-up options stay small there.
"""

from __future__ import annotations

import argparse

from broker.brokerset import MAX_BROKERS, BrokerSet
from broker.client import BrokerClient
from broker.endpoints import connect_endpoint
from broker.security import CurveClient


def add_broker_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--broker", action="append", default=None, type=connect_endpoint,
                   help="a broker's frontend endpoint; repeat it for several brokers "
                   f"(up to {MAX_BROKERS}): new calls go to a live one and move off a lost "
                   "one (default: [farm] broker_frontends in HOME/corral.toml; "
                   "docs/multihost.md)")


def resolve_brokers(ns: argparse.Namespace, configured: tuple[str, ...],
                    where: str) -> str | None:
    """``ns.broker`` from ``--broker`` (which wins) or the configured list; the error
    to show (None: fine)."""
    if not ns.broker:
        ns.broker = list(configured)
    if not ns.broker:
        return (f"no broker to use: give --broker ENDPOINT (repeat it for several), or "
                f'list them in {where}: [farm] broker_frontends = ["tcp://HOST:5555"]')
    if len(set(ns.broker)) > MAX_BROKERS:
        return f"at most {MAX_BROKERS} brokers, not {len(set(ns.broker))}"
    return None


def broker_link(ns: argparse.Namespace, *, curve: CurveClient | None,
                identity: bytes) -> BrokerClient | BrokerSet:
    """What the supervisor talks to: the one broker, or the set of them."""
    endpoints = list(dict.fromkeys(ns.broker))
    if len(endpoints) == 1:
        return BrokerClient(endpoints[0], heartbeat_interval_s=ns.heartbeat_interval_s,
                            liveness=ns.liveness, curve=curve, identity=identity)
    return BrokerSet(endpoints, heartbeat_interval_s=ns.heartbeat_interval_s,
                     liveness=ns.liveness, curve=curve, identity=identity)


def wants_curve(ns: argparse.Namespace) -> bool:
    """A tcp:// broker frontend is reached over CURVE (with ``--curve``)."""
    return any(ep.startswith("tcp://") for ep in ns.broker)
