"""Benchmark of images (docs/images.md): ``python -m supervisor.devtools.image_bench
[--quick] [--json]``; ``scripts/bench tools`` runs it and adds its figures.

Measured in one run, on this machine, so only ratios are compared:

- ``e2e_image_vs_host``: a sandboxed ``true`` (a ``shell`` call through a real
  broker and a real worker, from ``BrokerClient.start`` to the reply) over a
  busybox image's root, against the same call over the host's root,
  interleaved call by call (target <= 1.2);
- ``image_import_mb_per_s``: ``ImageStore.import_image`` of an OCI layout
  with one uncompressed layer of 2,000 files (about 80 MB), against ``tar -x``
  of the same layer into an empty directory (``image_import_vs_tar``).

The images are built here with ``tarfile`` (the bench needs no network and no
image tools); the busybox image needs ``/bin/busybox`` (busybox-static).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from broker.client import BrokerClient
from broker.devtools.children import print_table, ready_line, spawn, stop
from broker.protocol import pack, unpack
from supervisor.images.store import ImageStore

READY_TIMEOUT_S = 60.0
FILES = 2000
FILE_BYTES = 40_000


def _blob(root: Path, data: bytes) -> dict[str, Any]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    path = root / "blobs/sha256" / digest.removeprefix("sha256:")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return {"digest": digest, "size": len(data)}


def layout(root: Path, layer: bytes, config: dict[str, Any]) -> Path:
    """An OCI image layout of one uncompressed layer."""
    lay = _blob(root, layer)
    diff = lay["digest"]
    cfg = _blob(root, json.dumps({"architecture": "amd64" if os.uname().machine == "x86_64"
                                  else "arm64", "os": "linux", "config": config,
                                  "rootfs": {"type": "layers", "diff_ids": [diff]}}).encode())
    manifest = _blob(root, json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **cfg},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **lay}]}).encode())
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", **manifest}]}))
    return root


def _tar(entries: list[tuple[str, bytes | str | None]]) -> bytes:
    """A layer: (path, bytes) files, (path, "->target") symlinks, (path, None) dirs."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, what in entries:
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            if what is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif isinstance(what, str):
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, what[2:], 0o777
                tar.addfile(info)
            else:
                info.size, info.mode = len(what), 0o755
                tar.addfile(info, io.BytesIO(what))
    return buf.getvalue()


def busybox_layer() -> bytes:
    body = Path("/bin/busybox").read_bytes()
    # The mount points every real image has (debian, alpine, busybox from a registry).
    return _tar([("bin", None), ("bin/busybox", body), ("bin/sh", "->busybox"),
                 ("bin/true", "->busybox"), ("etc", None), ("etc/corral-marker", b"bench\n"),
                 ("proc", None), ("dev", None), ("tmp", None), ("workspace", None)])


def big_layer() -> bytes:
    entries: list[tuple[str, bytes | str | None]] = [("data", None)]
    for d in range(FILES // 100):
        entries.append((f"data/d{d}", None))
        entries += [(f"data/d{d}/f{i}", os.urandom(FILE_BYTES)) for i in range(100)]
    return _tar(entries)


def bench_import(tmp: Path, runs: int) -> dict[str, float]:
    layer = big_layer()
    lay = layout(tmp / "big", layer, {})
    tar_path = tmp / "layer.tar"
    tar_path.write_bytes(layer)
    imp: list[float] = []
    untar: list[float] = []
    for i in range(runs):
        home = tmp / f"home-{i}"
        t = time.perf_counter()
        ImageStore(home).import_image(lay)
        imp.append(time.perf_counter() - t)
        shutil.rmtree(home)
        out = tmp / f"x-{i}"
        out.mkdir()
        t = time.perf_counter()
        subprocess.run(["tar", "-x", "-f", str(tar_path), "-C", str(out)], check=True)
        untar.append(time.perf_counter() - t)
        shutil.rmtree(out)
    mb = len(layer) / 1e6
    return {"image_import_mb_per_s": round(mb / statistics.median(imp), 1),
            "tar_x_mb_per_s": round(mb / statistics.median(untar), 1),
            "image_import_layer_mb": round(mb, 1), "image_import_runs": runs}


async def _e2e(frontend: str, workspace: str, digest: str, n: int) -> tuple[list[float],
                                                                             list[float]]:
    image: list[float] = []
    host: list[float] = []
    async with BrokerClient(frontend) as client:
        for i in range(n + 3):
            for policy, into in (({"image": digest}, image), ({}, host)):
                body = pack({"call_id": f"b-{i}-{len(policy)}", "tool": "shell",
                             "arguments": {"command": ["true"]}, "session_id": "bench",
                             "workspace": workspace, "policy": policy})
                t = time.perf_counter()
                result = unpack(await client.start("tool", body, budget_s=60).result())
                dt = time.perf_counter() - t
                if result["outcome"] != "ok":
                    raise RuntimeError(f"bench call failed: {result['output']}")
                if i >= 3:  # the first calls probe each chain and grant the workspace
                    into.append(dt)
    return image, host


def bench_e2e(tmp: Path, n: int) -> dict[str, float]:
    home = tmp / "e2e-home"
    digest = ImageStore(home).import_image(layout(tmp / "bb", busybox_layer(),
                                                  {"Env": ["PATH=/bin"]})).digest
    workspace = tempfile.mkdtemp(prefix="corral-bench-ws-", dir="/tmp")
    os.chmod(workspace, 0o755)
    py = sys.executable
    procs: list[subprocess.Popen[bytes]] = []
    try:
        broker = spawn([py, "-m", "broker", "--frontend", f"ipc://{tmp}/f",
                        "--backend", f"ipc://{tmp}/b"])
        procs.append(broker)
        ready = ready_line(broker, READY_TIMEOUT_S)
        worker = spawn(
            [py, "-m", "sandbox_worker", "--broker", ready["backend"], "--services", "tool",
             "--capacity", "1", "--log-level", "WARNING", "--images", str(home / "images")])
        procs.append(worker)
        ready_line(worker, READY_TIMEOUT_S)
        image, host = asyncio.run(_e2e(ready["frontend"], workspace, digest, n))
    finally:
        stop(procs)
        shutil.rmtree(workspace, ignore_errors=True)
    img, hst = statistics.median(image) * 1000, statistics.median(host) * 1000
    return {"e2e_image_true_p50_ms": round(img, 3), "e2e_host_true_p50_ms": round(hst, 3),
            "e2e_image_vs_host": round(img / hst, 3), "e2e_image_samples": n}


def run(quick: bool) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="cbench-img-", dir="/tmp"))
    try:
        results: dict[str, Any] = {}
        if os.path.exists("/bin/busybox"):
            results.update(bench_e2e(tmp, 20 if quick else 60))
        else:
            results["e2e_image_skipped"] = "no /bin/busybox (apt-get install busybox-static)"
        results.update(bench_import(tmp, 1 if quick else 3))
        results["image_import_vs_tar"] = round(results["image_import_mb_per_s"]
                                               / results["tar_x_mb_per_s"], 3)
        results["load_1min"] = round(os.getloadavg()[0], 2)
        return results
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m supervisor.devtools.image_bench",
                                     description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--quick", action="store_true", help="a reduced run")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    ns = parser.parse_args(argv)
    results = run(ns.quick)
    if ns.json:
        print(json.dumps(results))
    else:
        print_table(results)
        print("(target: e2e_image_vs_host <= 1.2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
