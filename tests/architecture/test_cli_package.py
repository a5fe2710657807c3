"""Pins the shape of the ``corral`` CLI package (``supervisor/cli/``):

- its modules import each other without a circle (every import, lazy ones
  too: a function-level import that hides a circle is still a circle);
- dispatch is explicit: every command's sub-parser carries its own handler
  (``set_defaults(handler=...)``), no name lookup;
- only ``dev.py`` (``corral chaos``) imports dev tooling, inside its handler;
- building the parser stays light: no engine, store, farm, export or config
  module and no dev tooling is loaded by ``corral --help`` or ``corral
  completion`` (a shell start-up evals the latter).
"""

from __future__ import annotations

import argparse

from supervisor.cli import build_parser
from tests.architecture.graph import REPO, all_modules, find_cycle, graph
from tests.architecture.loaded import BUILD_PARSER, loaded_by

CLI = "supervisor.cli"


def test_the_cli_is_a_package_and_the_old_modules_are_gone() -> None:
    assert (REPO / "supervisor" / "cli" / "__init__.py").is_file()
    assert (REPO / "supervisor" / "cli" / "__main__.py").is_file()
    assert sorted(p.name for p in (REPO / "supervisor").glob("cli_*.py")) == []
    assert not (REPO / "supervisor" / "cli.py").exists()


def test_the_cli_package_has_no_import_circle() -> None:
    modules = {n: p for n, p in all_modules().items() if n == CLI or n.startswith(CLI + ".")}
    edges = graph(modules)
    assert len(modules) >= 10, sorted(modules)
    cycle = find_cycle(edges)
    assert cycle is None, "import circle in the CLI package: " + " -> ".join(cycle or [])


def test_the_package_root_is_only_imported_by_its_entry_point() -> None:
    """Submodules import each other, never ``supervisor.cli`` itself: its
    ``__init__`` imports the parser, which imports every command module."""
    modules = {n: p for n, p in all_modules().items() if n.startswith(CLI + ".")}
    importers = sorted(n for n, deps in graph(modules).items()
                       if CLI in deps and n != CLI + ".__main__")
    assert importers == []


def _leaf_parsers(parser: argparse.ArgumentParser, path: str
                  ) -> list[tuple[str, argparse.ArgumentParser]]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [(path, parser)]
    out: list[tuple[str, argparse.ArgumentParser]] = []
    for action in subs:
        for name, sub in action.choices.items():
            out += _leaf_parsers(sub, f"{path} {name}")
    return out


def test_every_command_is_bound_to_its_own_handler() -> None:
    leaves = _leaf_parsers(build_parser(), "corral")
    assert len(leaves) >= 20, [p for p, _ in leaves]
    unbound = [path for path, p in leaves if not callable(p.get_default("handler"))]
    assert unbound == []
    handlers = [p.get_default("handler") for _, p in leaves]
    names = [getattr(h, "func", h).__qualname__ for h in handlers]
    assert len(set(names)) == len(names), f"two commands share a handler: {sorted(names)}"


def test_only_the_dev_commands_import_dev_tooling() -> None:
    """``corral chaos`` (``supervisor.cli.dev``) is the one way in from the CLI."""
    modules = {n: p for n, p in all_modules().items() if n.startswith(CLI + ".")}
    reaching = sorted(n for n, deps in graph(modules).items()
                      if any(d.startswith("supervisor.chaos") or ".devtools" in d for d in deps))
    assert reaching == [CLI + ".dev"]


HEAVY = ("supervisor.engine", "supervisor.store", "supervisor.export", "supervisor.config",
         "supervisor.facade", "supervisor.farm.root", "supervisor.farm.layout",
         "supervisor.chaos")


def test_building_the_parser_loads_nothing_heavy() -> None:
    heavy = sorted(m for m in loaded_by(BUILD_PARSER)
                   if m.startswith(HEAVY) or ".devtools" in m)
    assert heavy == [], f"corral --help loads {heavy}"
