"""The import graph of ``supervisor/engine/``, read from the source (AST).

Every import counts: module level, inside functions, and under
``if TYPE_CHECKING:`` (a function-level import hides a cycle from Python, not
from the design). Pinned here:

- the turn machine (``machine.py``) is pure: within the engine it imports only
  the lifecycles and errors, outside it only the protocol leaf; it is in no
  cycle;
- the engine has no import cycle at all: the manager imports the session and
  the turn driver, the driver imports its action handlers (``toolround``,
  ``compaction``, ``exporting``), and those see the driver only through
  ``ports.TurnView``; the session sees its manager only through
  ``session.Host`` (docs/engine.md, "Modules"). A back-import anywhere (say
  ``toolround`` importing ``turn``, even under ``TYPE_CHECKING``) fails
  ``test_the_engine_has_no_import_cycle``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "supervisor" / "engine"
PREFIX = "supervisor.engine."

def _imports(path: Path) -> set[str]:
    """Every module name ``path`` imports, wherever the import statement is."""
    return _imports_in(path.read_text())


def _imports_in(source: str) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            out.add(node.module)
            if node.module == "supervisor.engine":  # from supervisor.engine import x
                out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def _graph() -> dict[str, set[str]]:
    modules = {p.stem for p in ENGINE.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for m in modules:
        deps = {i[len(PREFIX):].split(".")[0] for i in _imports(ENGINE / f"{m}.py")
                if i.startswith(PREFIX)}
        graph[m] = {d for d in deps if d in modules and d != m}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_turn_machine_is_pure() -> None:
    imported = _imports(ENGINE / "machine.py")
    engine = {i for i in imported if i.startswith(PREFIX)}
    # within the engine: only the other pure modules (lifecycles, errors, event
    # payload helpers, the approval key)
    pure = {f"{PREFIX}{m}" for m in ("phases", "errors", "events", "approvals")}
    assert engine <= pure, engine
    corral = {i for i in imported if i.split(".")[0] in ("broker", "supervisor",
                                                         "sandbox_worker")}
    assert corral - engine <= {"broker.protocol"}, corral
    # no I/O and no clock: the machine is given ``now`` and returns actions
    assert not imported & {"asyncio", "time", "socket", "sqlite3", "os", "zmq"}, imported
    # and no awaits, no coroutines, no file or console I/O of its own
    tree = ast.parse((ENGINE / "machine.py").read_text())
    awaiting = [n.lineno for n in ast.walk(tree) if isinstance(
        n, ast.AsyncFunctionDef | ast.Await | ast.AsyncWith | ast.AsyncFor)]
    assert awaiting == [], f"machine.py awaits at lines {awaiting}"
    io = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call)
          and isinstance(n.func, ast.Name) and n.func.id in ("open", "print", "input")]
    assert io == [], f"machine.py does I/O at lines {io}"


def test_the_pure_modules_are_in_no_cycle() -> None:
    in_cycles = set().union(*_cycles(_graph()))
    pure = {"machine", "phases", "errors", "events", "approvals", "ops", "bounds"}
    assert not pure & in_cycles, pure & in_cycles


def test_the_engine_has_no_import_cycle() -> None:
    assert _cycles(_graph()) == []


def test_the_graph_sees_function_level_and_type_checking_imports() -> None:
    # The reader itself: an import inside a function or under TYPE_CHECKING counts.
    tree = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from supervisor.engine.turn import Turn\n"
            "def f() -> None:\n    from supervisor.engine.session import Session\n")
    assert {"supervisor.engine.turn", "supervisor.engine.session"} <= _imports_in(tree)
