from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import Procs, searchable_dir

# pytest caches the assertion-rewritten test modules (tests/**/__pycache__/
# *-pytest-*.pyc) only when bytecode may be written; with
# PYTHONDONTWRITEBYTECODE set (CI, scripts/test's environment) every xdist
# worker parsed and rewrote all ~150 test modules on every run. The processes
# the tests start keep the variable.
sys.dont_write_bytecode = False


def pytest_configure(config: Any) -> None:
    report = os.environ.get("CORRAL_TEST_CPU_REPORT")
    if report:  # the suite's CPU budget per test (tests/cpureport.py)
        from tests.cpureport import CpuReport
        config.pluginmanager.register(CpuReport(Path(report)), "corral-cpureport")


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    """Start real processes; every one is killed and reaped by pid afterwards."""
    p = Procs(tmp_path / "logs")
    try:
        yield p
    finally:
        p.kill_all()


@pytest.fixture
def workspace_root() -> Iterator[Path]:
    """A directory the sandbox uid can reach (pytest's tmp_path sits under a 0700
    directory of root, which a tool's non-root uid cannot traverse)."""
    with searchable_dir("corral-test-", "/tmp") as root:
        yield root


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    """Print the sandbox tier this machine supports (detected by trying).

    It lives in the root conftest so it prints on whole-suite xdist runs too."""
    script = (
        "import asyncio\n"
        "from sandbox_worker.sandbox.detect import detect\n"
        "from sandbox_worker.sandbox.profile import Profile\n"
        "from sandbox_worker.sandbox.seccomp import SeccompFilters\n"
        "from sandbox_worker.sandbox.user import ensure_user\n"
        "async def main():\n"
        "    d = await detect(Profile('T2', await ensure_user(), SeccompFilters.compile(),"
        " None))\n"
        "    print(d.best, ','.join(d.working), d.landlock_abi, d.failures)\n"
        "asyncio.run(main())\n"
    )
    with contextlib.suppress(Exception):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True,
                             text=True, timeout=60, cwd=str(Path(__file__).parents[2]))
        best, working, abi, failures = [*out.stdout.strip().split(" ", 3), "", "", "", ""][:4]
        terminalreporter.section("corral sandbox")
        terminalreporter.write_line(f"detected sandbox tier: {best} (working tiers: {working}; "
                                    f"landlock ABI {abi}; failures: {failures})")


# Tests that each load the whole 2-core machine (a farm under faults, 1,000
# sessions, fork bombs, network namespaces). Under xdist they share one group
# (``--dist loadgroup`` in scripts/test), so they run one after another on one
# worker instead of starving each other, while the other worker takes the rest.
# (The fresh-clone test is not among them: it mostly waits on the package index.
# Nor is the crash matrix: its 12 cases take about 5 CPU-s each but 12-27 s of
# wall time, mostly waiting for their crash point and the restart; in the group
# they made its serial chain ~200 s longer, the suite's critical path.)
HEAVY = ("tests/chaos/test_chaos_runs.py", "tests/demo/test_demo.py::test_demo_survives",
         "test_scale.py::test_a_thousand",
         "test_uid_pool.py::test_fork_bomb", "tests/multihost/test_netns.py",
         "test_escape_resources.py::test_fork_bomb")


# Module- or package-scoped fixtures that cost nothing worth sharing (no process).
CHEAP_SHARED = frozenset({"user", "filters", "event_loop_policy"})


def shared_group(item: pytest.Item) -> str | None:
    """The xdist group of a test that uses a module- or package-scoped fixture that
    starts processes (a broker and workers, a farm): its module, or the fixture's
    package. Without it, ``--dist loadgroup`` spreads a module's tests over the
    workers and each worker starts the shared stack again (a sandbox module's two
    tier stacks cost about 3 CPU-s per start)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    for name in info.names_closure:
        if name in CHEAP_SHARED:
            continue
        for fixturedef in info.name2fixturedefs.get(name, ()):
            if fixturedef.scope == "package":
                return f"shared:{fixturedef.baseid or name}"
            if fixturedef.scope == "module":
                return f"shared:{item.nodeid.split('::')[0]}"
    return None


def pytest_collection_modifyitems(config: Any, items: list[pytest.Item]) -> None:
    for item in items:
        if any(part in item.nodeid for part in HEAVY):
            item.add_marker(pytest.mark.xdist_group("heavy"))
        elif item.get_closest_marker("xdist_group") is None and (group := shared_group(item)):
            item.add_marker(pytest.mark.xdist_group(group))


def running_pg() -> Iterator[Any]:
    """A real PostgreSQL (supervisor/devtools/pgserver.py), stopped by pid afterwards
    (the body of the PostgreSQL fixtures). Skips only when PostgreSQL is not installed
    (the bootstrap installs it where root)."""
    from supervisor.devtools.pgserver import PgServer, find_bindir

    if find_bindir() is None:
        pytest.skip("PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb); "
                    "scripts/_bootstrap.sh installs it where root")
    server = PgServer.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[Any]:
    """A PostgreSQL shared by the tests of one xdist worker."""
    yield from running_pg()
