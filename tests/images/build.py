"""Build real image inputs for the tests: layer tars, OCI layouts, OCI
archives and ``docker save`` tarballs, with tarfile/json/hashlib only."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.images.source import host_arch


@dataclass
class Entry:
    name: str
    type: bytes = tarfile.REGTYPE
    data: bytes = b""
    mode: int = 0o644
    link: str = ""
    size: int | None = None  # a lying header


def f(name: str, data: bytes = b"", mode: int = 0o644) -> Entry:
    return Entry(name, tarfile.REGTYPE, data, mode)


def d(name: str, mode: int = 0o755) -> Entry:
    return Entry(name, tarfile.DIRTYPE, mode=mode)


def sym(name: str, target: str) -> Entry:
    return Entry(name, tarfile.SYMTYPE, link=target, mode=0o777)


def hard(name: str, target: str) -> Entry:
    return Entry(name, tarfile.LNKTYPE, link=target)


def layer_tar(entries: list[Entry]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            ti = tarfile.TarInfo(e.name)
            ti.type = e.type
            ti.mode = e.mode
            ti.linkname = e.link
            ti.mtime = 1_700_000_000
            if e.type == tarfile.REGTYPE:
                ti.size = len(e.data)
                tar.addfile(ti, io.BytesIO(e.data))
            else:
                tar.addfile(ti)
    return buf.getvalue()


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class Built:
    blobs: dict[str, bytes] = field(default_factory=dict)
    index: bytes = b""
    manifest_digest: str = ""
    config: bytes = b""
    layer_tars: list[bytes] = field(default_factory=list)


def oci(layers: list[list[Entry]], *, gzip_layers: bool = True, arch: str | None = None,
        config_extra: dict[str, Any] | None = None) -> Built:
    b = Built()
    descs = []
    diff_ids = []
    for entries in layers:
        tar = layer_tar(entries)
        b.layer_tars.append(tar)
        blob = gzip.compress(tar, mtime=0) if gzip_layers else tar
        b.blobs[sha(blob)] = blob
        diff_ids.append(sha(tar))
        descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar"
                      + ("+gzip" if gzip_layers else ""), "digest": sha(blob),
                      "size": len(blob)})
    config = {"os": "linux", "architecture": arch or host_arch(),
              "config": {"Env": ["PATH=/usr/bin:/bin"], "WorkingDir": "/work"},
              "rootfs": {"type": "layers", "diff_ids": diff_ids}, **(config_extra or {})}
    b.config = json.dumps(config).encode()
    b.blobs[sha(b.config)] = b.config
    manifest = json.dumps({"schemaVersion": 2,
                           "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                      "digest": sha(b.config), "size": len(b.config)},
                           "layers": descs}).encode()
    b.manifest_digest = sha(manifest)
    b.blobs[b.manifest_digest] = manifest
    b.index = json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json",
         "digest": b.manifest_digest, "size": len(manifest)}]}).encode()
    return b


def write_layout(b: Built, path: Path) -> Path:
    (path / "blobs" / "sha256").mkdir(parents=True)
    (path / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (path / "index.json").write_bytes(b.index)
    for digest, data in b.blobs.items():
        (path / "blobs" / "sha256" / digest.removeprefix("sha256:")).write_bytes(data)
    return path


def _tar_of(files: dict[str, bytes], path: Path) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in files.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))
    return path


def write_archive(b: Built, path: Path) -> Path:
    files = {"oci-layout": b'{"imageLayoutVersion": "1.0.0"}', "index.json": b.index}
    files |= {"blobs/sha256/" + k.removeprefix("sha256:"): v for k, v in b.blobs.items()}
    return _tar_of(files, path)


def write_docker_save(b: Built, path: Path) -> Path:
    chex = sha(b.config).removeprefix("sha256:")
    layers = [f"{i:02d}/layer.tar" for i in range(len(b.layer_tars))]
    manifest = [{"Config": f"{chex}.json", "RepoTags": ["t:latest"], "Layers": layers}]
    files = {f"{chex}.json": b.config, "manifest.json": json.dumps(manifest).encode()}
    files |= dict(zip(layers, b.layer_tars, strict=True))
    return _tar_of(files, path)
