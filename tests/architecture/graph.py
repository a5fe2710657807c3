"""The import graph of Corral's packages, read from the source (AST), for the
architecture tests.

A module's imports are every ``import`` and ``from ... import`` statement in
it, at any depth (inside functions too: a lazy import is still an import, and
one placed in a function to hide a circle must not hide it from these tests),
except those under ``if TYPE_CHECKING:``. ``from P import n`` names the module
``P.n`` when that is a module, else ``P``. Relative imports are resolved
against the importing module.

Importing ``P.x`` also runs ``P/__init__.py``; that implicit edge to the parent
package is not counted (a package importing its own submodules is no circle).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("broker", "supervisor", "sandbox_worker")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    """Every module of the three packages: dotted name -> file."""
    return {module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skipped.update(id(n) for n in ast.walk(child))
    return skipped


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The Corral modules (names in ``known``) that module ``name`` imports."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = _type_checking_nodes(tree)
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(_closest(alias.name, known))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in known else _closest(base, known))
    found.discard("")
    return {m for m in found if m in known}


def _closest(dotted: str, known: set[str]) -> str:
    """The longest prefix of ``dotted`` that is a known module ('' if none)."""
    parts = dotted.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return ""


def graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the Corral modules it imports (all three packages)."""
    known = set(all_modules())
    return {name: imports_of(name, path, known) for name, path in modules.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle among ``edges``' nodes (as a path ending where it
    started), or None when the graph is acyclic."""
    nodes = set(edges)
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node] & nodes):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(nodes):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


def reachable(start: str, edges: dict[str, set[str]]) -> dict[str, str]:
    """Every module ``start`` imports, directly or not: module -> the module
    that imports it on one path from ``start`` (to explain a finding)."""
    seen: dict[str, str] = {start: ""}
    todo = [start]
    while todo:
        node = todo.pop()
        parts = node.split(".")
        parents = {".".join(parts[:i]) for i in range(1, len(parts))}
        for nxt in sorted((edges.get(node, set()) | parents) - seen.keys()):
            if nxt in edges:
                seen[nxt] = node
                todo.append(nxt)
    return seen


def path_to(target: str, via: dict[str, str]) -> list[str]:
    chain = [target]
    while via.get(chain[-1]):
        chain.append(via[chain[-1]])
    return list(reversed(chain))
