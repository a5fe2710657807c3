"""What the turn's action handlers (``toolround``, ``compaction``,
``exporting``) see of the turn driver (``turn.Turn``), and the signals they
end a turn with.

The driver imports the handlers; the handlers import this module, never the
driver: the engine's import graph has no cycle
(``tests/architecture/test_engine_imports.py``). ``TurnView`` is the narrow,
public face of ``Turn``: a handler reads the turn's ids and counters, commits
through its session and the helpers below, and never touches the driver's
private state.

Invariants:
- No handler writes ``CheckpointState.active_turn``, ``pending_tool_calls`` or
  ``pending_approval``: only the driver's ``Commit`` of the machine's state
  (``machine.py``) does. Handlers return events, or data the machine carries
  into its commits (``machine.Settle``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from sandbox_worker.api import Usage
from supervisor.engine.session import Session
from supervisor.store.records import CheckpointState, ExecutionRecord, SubmissionId, TurnId


class TurnRejected(Exception):
    """The turn ends with turn_aborted(rejected) (prompt hook, approval abort)."""


class TurnStopped(Exception):
    """A hook stopped the turn: a warning, then turn_complete."""


@dataclass(slots=True)
class Provisional:
    """A compaction that answered but is not durable yet (``compaction.settlement``)."""

    context: list[dict[str, Any]]
    usage: Usage
    block_id: str


Mutate = Callable[[CheckpointState], None]


class TurnView(Protocol):
    """The turn driver as its action handlers see it (``turn.Turn``)."""

    session: Session
    usage: Usage
    provisional: Provisional | None  # while the machine's notice is open
    force_compact: bool
    approval_requested_at: dict[str, float]

    @property
    def turn_id(self) -> TurnId: ...
    @property
    def submission_id(self) -> SubmissionId | None: ...
    @property
    def first_sequence(self) -> int: ...
    @property
    def tool_rounds(self) -> list[list[str]]: ...

    def note_tier(self, tier: str | None) -> None: ...
    def execution(self, outcome: str, reason: str | None = None) -> ExecutionRecord: ...
    def budget_s(self, cap_s: float) -> float: ...
