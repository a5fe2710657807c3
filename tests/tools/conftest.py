"""Fixtures for outside-tool tests: one farm (broker, two workers, the
scripted provider) for all of tests/tools in a test process (each test uses
its own session ids and workspaces), and the MCP servers' Python packages where
the sandbox can read them.

The sandbox binds /usr, /etc and /opt read-only (docs/sandbox.md), not this
checkout's .venv: ``sandbox_site`` hard-links the venv's site-packages (no data
is copied; one filesystem) under /opt/corral-test-site/KEY once, with the test
server beside them, and servers run as ``/usr/bin/python3 -m MODULE`` with
that ``PYTHONPATH``. Nothing is fetched from the network.

A hard link shares its file's mode, and the sandbox's uid reads the tree as
"other": a file the venv holds without o+r (uv links the venv's files from its
cache, which keeps the umask the cache was filled under; CI once had such a
cache) is copied with o+r added instead of linked, and every directory gets
o+rx, so the tree is readable whatever made the venv.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engine import farm as farm_mod
from tests.engine.farm import Farm, start_farm
from tests.helpers import Procs

SITE_ROOT = Path("/opt/corral-test-site")
HERE = Path(__file__).resolve().parent
SANDBOX_PYTHON = "/usr/bin/python3"


@pytest.fixture(scope="session")
def sandbox_site() -> str:
    src = Path(next(p for p in sys.path if p.endswith("site-packages")
                    and (Path(p) / "mcp").is_dir()))
    server = HERE / "corral_test_mcp_server.py"
    names = [*sorted(os.listdir(src)), hashlib.sha256(server.read_bytes()).hexdigest()]
    key = hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]
    dst = SITE_ROOT / key
    if not (dst / ".complete").exists():
        SITE_ROOT.mkdir(mode=0o755, exist_ok=True)
        tmp = SITE_ROOT / f".{key}.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        if subprocess.run(["cp", "-al", str(src), str(tmp)]).returncode != 0:
            # /opt on another filesystem: hard links cannot cross it; copy.
            shutil.rmtree(tmp, ignore_errors=True)
            subprocess.run(["cp", "-a", str(src), str(tmp)], check=True)
        _readable_by_all(tmp)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp / "corral_test_mcp_server.py")
        shutil.copy(server, tmp / "corral_test_mcp_server.py")
        (tmp / ".complete").touch()
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, dst)
        except OSError:  # another xdist worker made it first
            shutil.rmtree(tmp, ignore_errors=True)
    return str(dst)


def _readable_by_all(tree: Path) -> None:
    """Give every directory o+rx and every file o+r without touching the venv:
    a linked file that lacks o+r is replaced by a copy that has it."""
    for root, _dirs, files in os.walk(tree):
        os.chmod(root, stat.S_IMODE(os.lstat(root).st_mode) | 0o555)
        for name in files:
            path = Path(root) / name
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and not st.st_mode & stat.S_IROTH:
                copy = path.with_name(f".{name}.copy")
                shutil.copyfile(path, copy)
                os.chmod(copy, stat.S_IMODE(st.st_mode) | 0o444)
                os.replace(copy, path)


def server_spec(site: str, module: str, *args: str, **extra: Any) -> dict[str, Any]:
    """A ``[mcp.NAME]`` spec running ``python3 -m module args`` in the sandbox."""
    return {"command": [SANDBOX_PYTHON, "-m", module, *args],
            "env": {"PYTHONPATH": site, "PYTHONDONTWRITEBYTECODE": "1"}, **extra}


@pytest.fixture(scope="session")
def tools_farm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Farm]:
    tmp = tmp_path_factory.mktemp("tools-farm")
    procs = Procs(tmp / "logs")
    try:
        yield start_farm(procs, tmp, {"responses": [{"text": "ok"}]}, workers=2)
    finally:
        procs.kill_all()
        while farm_mod.CREATED_WORKSPACES:
            shutil.rmtree(farm_mod.CREATED_WORKSPACES.pop(), ignore_errors=True)
