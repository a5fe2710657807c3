"""Corral broker: reliable request-reply over ZeroMQ, and the wire protocol.

Public surface (pinned by tests/broker/test_exported_members.py):

- ``BrokerClient`` / ``Call``: the asyncio client (``broker.client``).
- ``BrokerWorker`` / ``RequestContext`` / ``Handler``: the asyncio worker
  (``broker.worker``).
- Errors: ``BrokerError``, ``RequestFailed``, ``BrokerUnavailable``,
  ``HandlerError`` (``broker.errors``, which draws the tree).
- ``FailureKind``: well-known failure kinds (``broker.protocol``).

The broker process itself is ``python -m broker`` (``broker.server``,
``broker.state``); the echo worker is ``python -m broker.echo``.
"""

from broker.client import BrokerClient, Call
from broker.errors import BrokerError, BrokerUnavailable, HandlerError, RequestFailed
from broker.protocol import FailureKind
from broker.worker import BrokerWorker, Handler, RequestContext

__all__ = [
    "BrokerClient",
    "BrokerError",
    "BrokerUnavailable",
    "BrokerWorker",
    "Call",
    "FailureKind",
    "Handler",
    "HandlerError",
    "RequestContext",
    "RequestFailed",
]
