"""Export at tool boundaries (placeholder until supervisor/export lands)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from supervisor.engine.turn import Turn


async def export_boundary(turn: Turn) -> None:
    if not turn.session.manager.export_sinks:
        return
