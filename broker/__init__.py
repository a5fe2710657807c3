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

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from broker.client import BrokerClient, Call
    from broker.errors import BrokerError, BrokerUnavailable, HandlerError, RequestFailed
    from broker.protocol import FailureKind
    from broker.worker import BrokerWorker, Handler, RequestContext

# Names are imported on first use (PEP 562): a process that needs one
# submodule does not pay for the whole package at start.
_LAZY: dict[str, str] = {
    "BrokerClient": "broker.client",
    "Call": "broker.client",
    "BrokerError": "broker.errors",
    "BrokerUnavailable": "broker.errors",
    "HandlerError": "broker.errors",
    "RequestFailed": "broker.errors",
    "FailureKind": "broker.protocol",
    "BrokerWorker": "broker.worker",
    "Handler": "broker.worker",
    "RequestContext": "broker.worker",
}


def __getattr__(name: str) -> _typing.Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


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
