"""The supervisor's session engine. See docs/engine.md.

Public surface: ``SessionManager``, ``EngineConfig``, ``SessionSpec``,
``Middleware`` / ``HookInput`` / ``HookResult`` and the errors of
``supervisor.engine.errors``.
"""

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from supervisor.engine.config import EngineConfig, SessionSpec
    from supervisor.engine.errors import (
        BadOp,
        EngineError,
        EngineNotRunning,
        HookFailed,
        IllegalTransition,
        SessionClosed,
        SubscriberDropped,
        TurnError,
        TurnLimitExceeded,
        UnknownSession,
        UsageObserverFailed,
    )
    from supervisor.engine.hooks import HookEvent, HookInput, HookResult, Middleware
    from supervisor.engine.manager import SessionManager
    from supervisor.engine.outage import StoreFailed

# Names are imported on first use (PEP 562): a process that needs one
# submodule does not pay for the whole package at start.
_LAZY: dict[str, str] = {
    "EngineConfig": "supervisor.engine.config",
    "SessionSpec": "supervisor.engine.config",
    "BadOp": "supervisor.engine.errors",
    "EngineError": "supervisor.engine.errors",
    "EngineNotRunning": "supervisor.engine.errors",
    "HookFailed": "supervisor.engine.errors",
    "IllegalTransition": "supervisor.engine.errors",
    "SessionClosed": "supervisor.engine.errors",
    "SubscriberDropped": "supervisor.engine.errors",
    "TurnError": "supervisor.engine.errors",
    "TurnLimitExceeded": "supervisor.engine.errors",
    "UnknownSession": "supervisor.engine.errors",
    "UsageObserverFailed": "supervisor.engine.errors",
    "HookEvent": "supervisor.engine.hooks",
    "HookInput": "supervisor.engine.hooks",
    "HookResult": "supervisor.engine.hooks",
    "Middleware": "supervisor.engine.hooks",
    "SessionManager": "supervisor.engine.manager",
    "StoreFailed": "supervisor.engine.outage",
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
