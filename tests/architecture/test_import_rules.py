"""Pins the process boundaries of docs/architecture.md: who may import whom.

- broker imports neither supervisor nor sandbox_worker;
- broker.protocol is a leaf: standard library and msgpack only;
- sandbox_worker never imports supervisor;
- supervisor imports from sandbox_worker only its public ``sandbox_worker.api``;
- sandbox_worker.api imports the standard library only.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("broker", "supervisor", "sandbox_worker")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _modules(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def _top(name: str) -> str:
    return name.split(".")[0]


@pytest.mark.parametrize("package", PACKAGES)
def test_package_exists_with_entry_point(package: str) -> None:
    assert (REPO / package / "__init__.py").is_file()
    assert (REPO / package / "__main__.py").is_file(), f"{package} needs python -m {package}"


def test_broker_imports_no_other_corral_package() -> None:
    for path in _modules("broker"):
        bad = {i for i in _imports(path) if _top(i) in ("supervisor", "sandbox_worker")}
        assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"


def test_protocol_is_a_leaf() -> None:
    allowed = set(sys.stdlib_module_names) | {"msgpack"}
    bad = {i for i in _imports(REPO / "broker" / "protocol.py") if _top(i) not in allowed}
    assert not bad, f"broker/protocol.py must stay a leaf; it imports {sorted(bad)}"


def test_sandbox_worker_never_imports_supervisor() -> None:
    for path in _modules("sandbox_worker"):
        bad = {i for i in _imports(path) if _top(i) == "supervisor"}
        assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"


def test_supervisor_uses_only_the_public_worker_api() -> None:
    for path in _modules("supervisor"):
        bad = {
            i for i in _imports(path)
            if _top(i) == "sandbox_worker" and not (
                i == "sandbox_worker.api" or i.startswith("sandbox_worker.api.")
                or i == "sandbox_worker"  # `from sandbox_worker import api`
            )
        }
        assert not bad, f"{path.relative_to(REPO)} reaches into worker internals: {sorted(bad)}"


def test_worker_api_depends_on_the_standard_library_only() -> None:
    allowed = set(sys.stdlib_module_names)
    bad = {i for i in _imports(REPO / "sandbox_worker" / "api.py") if _top(i) not in allowed}
    assert not bad, f"sandbox_worker/api.py must stay dependency-free; it imports {sorted(bad)}"
