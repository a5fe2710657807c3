"""The directory sink keeps a bounded number of checkpoints per session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from supervisor.export import DirectorySink


def _doc(session: str, turn: int) -> dict[str, Any]:
    return {"descriptor": {"session_id": session, "turn": turn,
                           "digest": f"sha256:{turn:064x}"}, "body": "x" * 10}


async def test_only_the_newest_checkpoints_of_a_session_are_kept(tmp_path: Path) -> None:
    sink = DirectorySink(tmp_path, keep_per_session=3)
    for turn in range(1, 8):
        await sink.export(_doc("sess_a", turn))
        await sink.export(_doc("sess_ab", turn))  # a session whose id extends the other's
    assert _turns(tmp_path, "sess_a") == ["0005", "0006", "0007"]
    assert _turns(tmp_path, "sess_ab") == ["0005", "0006", "0007"]
    assert not _names(tmp_path, ".*.tmp")


def _names(d: Path, pattern: str) -> list[str]:
    return sorted(p.name for p in d.glob(pattern))


def _turns(d: Path, session: str) -> list[str]:
    return [n.split("-t")[1][:4] for n in _names(d, f"{session}-t*.json")]


def test_keep_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_per_session"):
        DirectorySink(tmp_path, keep_per_session=0)
