"""Exceptions of the broker package's public client and worker APIs.

Foreign errors (``zmq.ZMQError``) are translated into these at one boundary,
``broker.transport``; nothing from pyzmq leaks to callers. Failures that cross
processes travel as data (a FAILURE message carrying one ``protocol.Failure``:
kind, message, retryable) and become ``RequestFailed`` on the caller's side;
tracebacks stay in local logs. ``RequestFailed`` and ``HandlerError`` are also
``protocol.Failed``: ``exc.failure`` is the data.

Exception tree::

    BrokerError                   base of everything raised by broker.client / broker.worker
    ├── RequestFailed             the request's final answer was a FAILURE (from the broker,
    │                             the worker, or the client itself: local deadline, broker
    │                             restart or silence, slow consumer, client closed)
    ├── BrokerUnavailable         the client or worker is not running (used outside
    │                             ``async with`` / after close), or its socket failed
    └── HandlerError              raised by a worker handler on purpose; the worker turns it
                                  into FAILURE(kind, message, retryable, body)

The wire protocol's own tree (``ProtocolError`` and subclasses) lives in
``broker.protocol``; the client and worker count and drop malformed frames
instead of raising it.
"""

from __future__ import annotations

from broker import protocol


class BrokerError(Exception):
    """Base class of the broker package's client/worker exceptions."""


class RequestFailed(BrokerError, protocol.Failed):
    """A request ended in a FAILURE; ``kind`` and ``retryable`` say what to do next
    (``failure`` is the ``protocol.Failure`` it carried, ``body`` its payload)."""

    def __init__(self, reply: protocol.FailureReply) -> None:
        protocol.Failed.__init__(self, reply.message, kind=reply.kind,
                                 retryable=reply.retryable)
        self.body = reply.body

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


class BrokerUnavailable(BrokerError):
    """The client or worker is not running, or its socket failed."""


class HandlerError(BrokerError, protocol.Failed):
    """Raised by a worker handler to answer with FAILURE(kind, message, retryable, body)."""

    def __init__(self, kind: str, message: str, *, retryable: bool, body: bytes = b"") -> None:
        protocol.Failed.__init__(self, message, kind=kind, retryable=retryable)
        self.body = body

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"
