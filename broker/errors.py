"""Exceptions of the broker package's public client and worker APIs.

Foreign errors (``zmq.ZMQError``) are translated into these at one boundary,
``broker.transport``; nothing from pyzmq leaks to callers. Failures that cross
processes travel as data (``protocol.Failure``: kind, message, retryable) and
become ``RequestFailed`` on the caller's side; tracebacks stay in local logs.

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


class RequestFailed(BrokerError):
    """A request ended in a FAILURE; ``kind`` and ``retryable`` say what to do next."""

    def __init__(self, failure: protocol.Failure) -> None:
        super().__init__(f"{failure.kind}: {failure.message}")
        self.failure = failure

    @property
    def kind(self) -> str:
        return self.failure.kind

    @property
    def message(self) -> str:
        return self.failure.message

    @property
    def retryable(self) -> bool:
        return self.failure.retryable

    @property
    def body(self) -> bytes:
        return self.failure.body


class BrokerUnavailable(BrokerError):
    """The client or worker is not running, or its socket failed."""


class HandlerError(BrokerError):
    """Raised by a worker handler to answer with FAILURE(kind, message, retryable, body)."""

    def __init__(self, kind: str, message: str, *, retryable: bool, body: bytes = b"") -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message
        self.retryable = retryable
        self.body = body
