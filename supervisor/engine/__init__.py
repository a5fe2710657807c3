"""The supervisor's session engine. See docs/engine.md.

Public surface: ``SessionManager``, ``EngineConfig``, ``SessionSpec``,
``Middleware`` / ``HookInput`` / ``HookResult`` and the errors of
``supervisor.engine.errors``.
"""

from supervisor.engine.config import EngineConfig, SessionSpec
from supervisor.engine.errors import (
    BadOp,
    EngineError,
    EngineNotRunning,
    HookFailed,
    IllegalTransition,
    ModelCallFailed,
    SessionClosed,
    SubscriberDropped,
    TurnError,
    TurnLimitExceeded,
    UnknownSession,
    UsageObserverFailed,
)
from supervisor.engine.hooks import HookEvent, HookInput, HookResult, Middleware
from supervisor.engine.manager import SessionManager, StoreFailed

__all__ = [
    "BadOp",
    "EngineConfig",
    "EngineError",
    "EngineNotRunning",
    "HookEvent",
    "HookFailed",
    "HookInput",
    "HookResult",
    "IllegalTransition",
    "Middleware",
    "ModelCallFailed",
    "SessionClosed",
    "SessionManager",
    "SessionSpec",
    "StoreFailed",
    "SubscriberDropped",
    "TurnError",
    "TurnLimitExceeded",
    "UnknownSession",
    "UsageObserverFailed",
]
