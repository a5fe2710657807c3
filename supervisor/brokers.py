"""The supervisor's link to its brokers: one ``BrokerClient``, or a ``BrokerSet``
when ``--broker`` is repeated (docs/multihost.md, "Several brokers").

Kept apart from ``supervisor/main.py`` so start-up options stay small there.
"""

from __future__ import annotations

import argparse

from broker.brokerset import MAX_BROKERS, BrokerSet
from broker.client import BrokerClient
from broker.security import CurveClient


def add_broker_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--broker", required=True, action="append",
                   help="a broker's frontend endpoint; repeat it for several brokers "
                   f"(up to {MAX_BROKERS}): new calls go to a live one and move off a lost "
                   "one (docs/multihost.md)")


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
