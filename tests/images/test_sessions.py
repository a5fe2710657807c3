"""Sessions in an image through a real embedded farm: the Python API
(``SessionOptions(image=...)``) and ``corral run --image``; the image is
resolved to its digest at session creation, persisted in the session's config,
and a missing one is refused there, never at the first tool call."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from supervisor.images.store import ImageStore
from supervisor.sdk import EmbeddedFarm, SessionOptions, SupervisorError, ToolCallEnd
from tests.helpers import searchable_dir
from tests.images.real import MARKER, busybox_image, need_tools
from tests.sdk.farms import running_farm

# One farm for the module, also under xdist (--dist loadgroup).
pytestmark = [pytest.mark.timeout(120), pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.xdist_group("images-sessions")]
SCRIPT = {"responses": [
    {"tool_calls": [{"name": "shell", "arguments": {"command": "cat /etc/corral-marker; pwd"}}]},
    {"text": "done"},
    {"tool_calls": [{"name": "shell", "arguments": {"command": "cat /etc/corral-marker; pwd"}}]},
    {"text": "done again"},
]}


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    need_tools()
    tmp = tmp_path_factory.mktemp("img-sessions")
    home = tmp / "home"
    digest = ImageStore(home).import_image(busybox_image(tmp / "bb"), "tools/bb:1").digest
    return home, digest


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def farm(home: tuple[Path, str]) -> AsyncIterator[EmbeddedFarm]:
    async with running_farm(home=home[0], script=SCRIPT, workers=1) as f:
        yield f


@pytest.fixture
def workspace() -> Iterator[Path]:
    with searchable_dir("corral-img-ws-", "/tmp") as path:
        yield path


async def test_a_session_in_an_image_through_the_api(farm: EmbeddedFarm, home: tuple[Path, str],
                                                     workspace: Path) -> None:
    digest = home[1]
    async with farm.connect() as corral:
        with pytest.raises(SupervisorError) as missing:
            await corral.create_session(SessionOptions(workspace=workspace, image="no/such:1"))
        assert missing.value.kind == "image_not_found"
        session = await corral.create_session(SessionOptions(
            workspace=workspace, approval="allow", image="tools/bb:1"))
        events = [e async for e in session.run("go", timeout_s=60)]
        described = await session.describe()
    end = next(e for e in events if isinstance(e, ToolCallEnd))
    assert end.state == "ok", end.output
    assert end.output == f"{MARKER}/app\n"
    assert end.isolation["image"]["digest"] == digest
    assert described["image"] == digest  # from the session's config


async def test_corral_run_image(tmp_path: Path, workspace: Path) -> None:
    """The README's example: import with the CLI, run a session in the image
    (a temporary farm of one worker, a scripted model)."""
    need_tools()
    home = tmp_path / "home"
    script = tmp_path / "script.json"
    script.write_text(json.dumps(SCRIPT))

    def corral(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "supervisor.cli", *args, "--home",
                               str(home)], capture_output=True, text=True, timeout=90,
                              check=False)

    imported = corral("image", "import", str(busybox_image(tmp_path / "bb")), "--name",
                      "tools/bb:1", "--json")
    assert imported.returncode == 0, imported.stderr
    digest = json.loads(imported.stdout)["image"]["digest"]
    ok = corral("run", "--model", f"script:{script}", "--workers", "1", "--image",
                f"tools/bb@{digest}", "--workspace", str(workspace), "--approval", "allow",
                "--json", "go")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    ended = [json.loads(line) for line in ok.stdout.splitlines()
             if '"tool_call_end"' in line or '"exec_command_end"' in line]
    assert ended, ok.stdout
    assert digest in ok.stdout, ok.stdout  # the tool result's isolation record
    assert "corral image marker" in ok.stdout, ended
