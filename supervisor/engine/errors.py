"""Errors of the session engine, drawn as one tree.

Callers of ``SessionManager`` see the ``EngineError`` subclasses; everything
foreign (broker ``RequestFailed``, store errors, a middleware's own exception)
is translated at one boundary into the types below, with ``raise ... from``.

Exception tree::

    EngineError                       base of everything the engine raises; a
    │                                 ``broker.protocol.Failed``: ``exc.failure`` is
    │                                 the (kind, message, retryable) sent as data
    ├── UnknownSession                no such session (or it is not loaded here)
    ├── SessionClosed                 the session was shut down; it takes no ops
    ├── BadOp                         a malformed op; the message says what is wrong
    ├── EngineNotRunning              ``SessionManager.run`` is not running
    ├── SubscriberDropped             (slow_consumer) a subscriber fell behind its bounded queue;
    │                                 resubscribe from ``last_sequence``
    ├── IllegalTransition             a turn phase or tool-call state moved illegally
    │                                 (a bug; raised, never swallowed)
    ├── CallFailed                    a model or tool request ended in a broker FAILURE
    │                                 (``calls.py``; its kind is the broker's)
    └── TurnError                     ends a turn; sent as an ``error`` event
        ├── HookFailed                a middleware or command hook raised / crashed:
        │                             an infrastructure failure, the turn fails
        ├── UsageObserverFailed       the usage observer raised; usage not committed
        └── TurnLimitExceeded         model steps per turn or total turn time ran out

Invariants:
- No ``EngineError`` ever kills a session: the session loop turns a
  ``TurnError`` into a failed turn with a record, and ``BadOp`` /
  ``UnknownSession`` are raised to the caller of ``submit`` only.
- ``asyncio.CancelledError`` is never caught and dropped by the engine.
"""

from __future__ import annotations

from broker.protocol import Failed, FailureKind


class EngineError(Failed):
    """Base of every error the session engine raises."""


class UnknownSession(EngineError):
    """No session with this id exists in this manager."""


class SessionClosed(EngineError):
    """The session was shut down and takes no more ops."""


class BadOp(EngineError):
    """A malformed op. The message names the field and what is wrong with it."""


class EngineNotRunning(EngineError):
    """``SessionManager.run`` must be running for this call."""


class SubscriberDropped(EngineError):
    """The subscriber's bounded queue overflowed; it was dropped.

    Resubscribe with ``after_sequence=last_sequence`` to continue without a gap.
    """

    kind = "slow_consumer"

    def __init__(self, message: str, *, last_sequence: int) -> None:
        super().__init__(message)
        self.last_sequence = last_sequence


class IllegalTransition(EngineError):
    """A lifecycle moved along an edge its state machine does not have."""


class CallFailed(EngineError):
    """A model or tool request that ended in a broker FAILURE, as data."""

    def __init__(self, kind: str, message: str, retryable: bool) -> None:
        super().__init__(message, kind=kind, retryable=retryable)

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"

    @property
    def worker_lost(self) -> bool:
        return self.kind == FailureKind.WORKER_LOST


class TurnError(EngineError):
    """An error that ends a turn, sent to clients as an ``error`` event (its ``failure``)."""


class HookFailed(TurnError):
    """A hook raised, timed out or crashed: an infrastructure failure."""

    kind = "hook_failed"


class UsageObserverFailed(TurnError):
    """The usage observer raised; the turn aborts before the usage is committed."""

    kind = "usage_observer_failed"


class TurnLimitExceeded(TurnError):
    """A turn ran out of model steps or of total time."""

    kind = "turn_limit"
