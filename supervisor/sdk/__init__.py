"""Corral's public Python API: run sandboxed agent sessions from your program.

It lives in ``supervisor.sdk`` because it is a client of the supervisor (the
process that owns sessions) and starts farms with the supervisor's own farm
code (``supervisor.farm``); the top-level packages are fixed (``broker``,
``supervisor``, ``sandbox_worker``), and the SDK imports nothing of
``sandbox_worker`` but its public ``api`` module. docs/sdk.md is the guide.

- ``EmbeddedFarm``: a temporary farm for an ``async with`` block.
- ``Corral``: a connection to a farm (``Corral(endpoint, curve=...)``,
  ``Corral.for_home(home)``, ``farm.connect()``).
- ``Session``: ``run`` a turn as an async iterator of typed events,
  ``approve``, ``interrupt``, ``export``; ``import_checkpoint`` resumes one.
- ``tool``: client tools, Python functions of this program the model calls.
- hooks: ``HookInput`` -> ``HookResult`` callables run in this program.
- ``SyncCorral``: the same without ``await``, for scripts and notebooks.

Exception tree::

    SupervisorError(kind, message)   the supervisor refused (bad_request,
    │                                unknown_session, bad_op, not_found, ...)
    └── SupervisorUnavailable        no answer within the deadline
    FarmError                        an embedded farm could not start
    ImportRefused(kind, message)     import_checkpoint refused the checkpoint
"""

from supervisor.client import SupervisorError, SupervisorUnavailable
from supervisor.engine.hooks import HookEvent, HookInput, HookResult
from supervisor.sdk.checkpoints import ImportRefused, import_checkpoint
from supervisor.sdk.corral import Corral, Decision, HookFunction, Session
from supervisor.sdk.events import (
    AgentMessage,
    AgentMessageDelta,
    AgentReasoningDelta,
    ApprovalCall,
    CallError,
    ContextCompacted,
    ErrorEvent,
    Event,
    ExecApprovalRequest,
    FrontendRender,
    ModelStepCompleted,
    ModelStepStarted,
    SessionConfigured,
    TokenCount,
    ToolCallBegin,
    ToolCallEnd,
    ToolCallOutputDelta,
    TurnAborted,
    TurnComplete,
    TurnStarted,
    UserMessage,
    WarningEvent,
    parse_event,
)
from supervisor.sdk.farm import EmbeddedFarm, FarmError
from supervisor.sdk.options import SessionOptions
from supervisor.sdk.sync import SyncCorral, SyncSession
from supervisor.sdk.tools import ClientTool, ToolOutcome, schema_from_hints, tool

__all__ = [
    "AgentMessage", "AgentMessageDelta", "AgentReasoningDelta", "ApprovalCall", "CallError",
    "ClientTool", "ContextCompacted", "Corral", "Decision", "EmbeddedFarm", "ErrorEvent",
    "Event", "ExecApprovalRequest", "FarmError", "FrontendRender", "HookEvent",
    "HookFunction", "HookInput", "HookResult", "ImportRefused", "ModelStepCompleted",
    "ModelStepStarted", "Session", "SessionConfigured", "SessionOptions", "SupervisorError",
    "SupervisorUnavailable", "SyncCorral", "SyncSession", "TokenCount", "ToolCallBegin",
    "ToolCallEnd", "ToolCallOutputDelta", "ToolOutcome", "TurnAborted", "TurnComplete",
    "TurnStarted", "UserMessage", "WarningEvent", "import_checkpoint", "parse_event",
    "schema_from_hints", "tool",
]
