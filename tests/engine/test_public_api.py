"""Pin the engine's public surface (what the supervisor process and CLI use)."""

from __future__ import annotations

import inspect

import supervisor.engine as engine
from supervisor.engine import SessionManager


def test_exported_members() -> None:
    assert sorted(engine.__all__) == sorted([
        "BadOp", "EngineConfig", "EngineError", "EngineNotRunning", "HookEvent", "HookFailed",
        "HookInput", "HookResult", "IllegalTransition", "Middleware", "SessionClosed",
        "SessionManager", "SessionSpec", "StoreFailed", "SubscriberDropped", "TurnError",
        "TurnLimitExceeded", "UnknownSession", "UsageObserverFailed"])
    for name in engine.__all__:
        assert getattr(engine, name) is not None


def test_session_manager_api() -> None:
    params = inspect.signature(SessionManager.__init__).parameters
    assert list(params)[1:] == ["store", "broker", "config", "middleware_factory",
                                "usage_observer", "export_sinks"]
    for name in ("run", "create_session", "submit", "list_sessions", "describe"):
        assert inspect.iscoroutinefunction(getattr(SessionManager, name)), name
    assert not inspect.iscoroutinefunction(SessionManager.subscribe)
    assert list(inspect.signature(SessionManager.subscribe).parameters) == [
        "self", "session_id", "after_sequence"]
    assert not inspect.iscoroutinefunction(SessionManager.stats)


def test_the_engine_imports_no_worker_internals() -> None:
    import pathlib
    import re

    root = pathlib.Path(engine.__file__).parent
    for path in root.glob("*.py"):
        for line in path.read_text().splitlines():
            m = re.match(r"\s*(?:from|import) (sandbox_worker[\w.]*)", line)
            if m:
                assert m.group(1) == "sandbox_worker.api", f"{path.name}: {line}"
