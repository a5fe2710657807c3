"""``corral image`` end to end through the real CLI: an import SIGKILLed in the
middle of a layer leaves nothing visible, the next import sweeps its remains,
and import/ls/rm work with their JSON and their errors."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import wait_until
from tests.images.build import f, oci, write_layout

pytestmark = pytest.mark.timeout(60)


def corral(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor.cli", *args, "--home", str(home)],
                          capture_output=True, text=True, timeout=30, check=False)


def test_sigkill_mid_import_leaves_nothing_then_import_ls_rm(tmp_path: Path) -> None:
    home = tmp_path / "home"
    first = os.urandom(100_000)
    b = oci([[f("first", first), f("second", os.urandom(1 << 20))]], gzip_layers=False)
    layout = write_layout(b, tmp_path / "l")
    layer = json.loads(b.blobs[b.manifest_digest])["layers"][0]["digest"]
    blob_path = layout / "blobs/sha256" / layer.removeprefix("sha256:")
    blob = blob_path.read_bytes()
    blob_path.unlink()
    os.mkfifo(blob_path)  # the import reads the layer only as fast as the test feeds it
    fifo = os.open(blob_path, os.O_RDWR)
    try:
        fcntl.fcntl(fifo, fcntl.F_SETPIPE_SZ, 1 << 20)
        os.write(fifo, blob[:300_000])  # 'first' whole, 'second' begun
        proc = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "image", "import",
                                 str(layout), "--name", "victim", "--home", str(home)])
        try:
            wait_until(lambda: proc.poll() is not None or any(
                p.stat().st_size == len(first)
                for p in (home / "images/tmp").glob("*/rootfs/first")),
                timeout_s=20, what="the import to unpack 'first'")
            assert proc.poll() is None, "the import ended before it was killed"
            proc.kill()
        finally:
            proc.kill()
            proc.wait(10)
    finally:
        os.close(fifo)
    assert proc.returncode == -9
    ls = corral("image", "ls", "--json", home=home)
    assert ls.returncode == 0
    assert json.loads(ls.stdout) == {"ok": True, "images": []}
    assert os.listdir(home / "images/sha256") == []
    assert not (home / "images/refs.json").exists()
    assert os.listdir(home / "images/tmp")  # the killed import's remains, not visible

    blob_path.unlink()
    blob_path.write_bytes(blob)
    done = corral("image", "import", str(layout), "--name", "tools/x:1", "--json", home=home)
    assert done.returncode == 0, done.stderr
    image = json.loads(done.stdout)["image"]
    assert image["digest"] == b.manifest_digest
    assert image["names"] == ["tools/x:1"]
    assert os.listdir(home / "images/tmp") == []  # swept: its owner is dead
    ls = corral("image", "ls", home=home)
    assert b.manifest_digest[:19] in ls.stdout
    assert "tools/x:1" in ls.stdout

    gone = corral("image", "rm", "tools/x:1", "--json", home=home)
    assert json.loads(gone.stdout) == {"ok": True, "digest": b.manifest_digest,
                                       "untagged": ["tools/x:1"], "removed": True}
    missing = corral("image", "rm", "tools/x:1", "--json", home=home)
    assert missing.returncode == 1
    error = json.loads(missing.stdout)["error"]
    assert error["kind"] == "image_not_found"
    assert "corral image import" in error["message"]
