"""Fixtures of the CLI tests: farms' homes whose every process is killed afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli.test_cli_e2e import _farm_json, processes_naming
from tests.helpers import kill_tree


@pytest.fixture
def homes(workspace_root: Path) -> Iterator[list[Path]]:
    """Homes the test creates; every process of their farms is killed afterwards."""
    created: list[Path] = []
    yield created
    for home in created:
        info = _farm_json(home)
        pids = [c.get("pid") for c in (info or {}).get("children", [])]
        for pid in [(info or {}).get("root_pid"), *pids]:
            if isinstance(pid, int):
                kill_tree(pid)
        for p in processes_naming(home):
            kill_tree(p.pid)
