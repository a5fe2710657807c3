"""Pins that benchmark, demo and chaos code stays out of production processes.

Dev tooling lives in one ``devtools`` subpackage per process package
(``broker/devtools/``, ``sandbox_worker/devtools/``, ``supervisor/devtools/``;
one per package so that each keeps the import rules of test_import_rules.py)
and in the chaos harness ``supervisor/chaos/``. What ``python -m broker``,
``python -m sandbox_worker``, ``python -m supervisor``, the farm's root
(``python -m supervisor.farm``) and the ``corral`` parser load must contain
none of it:

- at run time: each entry is imported in a fresh interpreter and its
  ``sys.modules`` is checked;
- in the source: nothing those entries import, directly or through any chain
  of imports (lazy ones inside functions included), is dev tooling;
- and a module named for a benchmark or a demo lives in a ``devtools``
  package, so new ones cannot land in a production path unnoticed.

The scripted provider (``sandbox_worker/fakellm``), the echo worker
(``broker/echo.py``) and the planted-bug switches read by production code
(``broker/plants.py``, ``broker/faults.py``, ``supervisor/crashpoints.py``,
all off unless asked for) are not dev tooling in this sense.
"""

from __future__ import annotations

import pytest

from tests.architecture.graph import all_modules, graph, path_to, reachable
from tests.architecture.loaded import BUILD_PARSER, loaded_by

# What each production process runs: ``python -m X`` imports these (the
# ``__main__`` of supervisor and sandbox_worker is two lines calling ``main``).
ENTRIES = ("broker.__main__", "sandbox_worker.main", "supervisor.main",
           "supervisor.farm.__main__")


def is_dev(module: str) -> bool:
    parts = module.split(".")
    return "devtools" in parts or parts[:2] == ["supervisor", "chaos"]


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_production_process_loads_no_dev_tooling(entry: str) -> None:
    dev = sorted(m for m in loaded_by(f"import {entry}") if is_dev(m))
    assert dev == [], f"importing {entry} loads {dev}"


def test_the_corral_parser_loads_no_dev_tooling() -> None:
    dev = sorted(m for m in loaded_by(BUILD_PARSER) if is_dev(m))
    assert dev == [], f"building corral's parser loads {dev}"


def test_no_import_chain_from_a_production_entry_reaches_dev_tooling() -> None:
    edges = graph(all_modules())
    for entry in (*ENTRIES, "supervisor.__main__", "sandbox_worker.__main__"):
        via = reachable(entry, edges)
        dev = sorted(m for m in via if is_dev(m))
        assert not dev, (f"{entry} reaches dev tooling: "
                         + " -> ".join(path_to(dev[0], via)))


def test_benchmarks_and_demos_live_in_devtools() -> None:
    misplaced = sorted(
        name for name in all_modules()
        if any(word in part for part in name.split(".") for word in ("bench", "demo"))
        and not is_dev(name))
    assert misplaced == []
