"""Images made by real tools import to the same root: an OCI layout from
umoci, and the same image as ``skopeo copy`` writes it to a ``docker save``
archive and to an OCI archive (each has its own manifest digest; the root's
tree digest, what a worker checks before it binds it, is the same)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from supervisor.images.store import ImageStore
from tests.images.real import busybox_image, docker_archive, need_tools

pytestmark = pytest.mark.timeout(120)


def tree(store: ImageStore, digest: str) -> str:
    meta = store.root / "sha256" / digest.removeprefix("sha256:") / "image.json"
    return str(json.loads(meta.read_text())["rootfs_sha256"])


def test_umoci_and_skopeo_formats_give_one_root(tmp_path: Path) -> None:
    need_tools()
    layout = busybox_image(tmp_path / "l")
    store = ImageStore(tmp_path / "home")
    oci = store.import_image(layout, "bb:oci")
    docker = store.import_image(docker_archive(layout, "bb", tmp_path / "d.tar"), "bb:docker")
    archive = tmp_path / "o.tar"
    subprocess.run(["skopeo", "copy", f"oci:{layout}:bb", f"oci-archive:{archive}:bb"],
                   check=True, capture_output=True, timeout=60)
    oci_archive = store.import_image(archive, "bb:archive")
    assert docker.source == "docker-archive"
    assert docker.digest != oci.digest
    assert tree(store, oci.digest) == tree(store, docker.digest) == tree(store, oci_archive.digest)
    root = store.rootfs(oci.digest)
    assert (root / "etc/corral-marker").read_text() == "corral image marker\n"
    assert (root / "bin/sh").readlink() == Path("busybox")
