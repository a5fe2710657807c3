"""Read an image to import: an OCI image layout directory, an OCI archive (a
tar of a layout, optionally gzipped), or a ``docker save`` tarball (or its
unpacked directory). Each gives one ``Image``: the manifest (bytes and
digest), the config, and its layers as streams to verify while reading.

Invariants:
- Every blob read is checked against its digest: the manifest and config
  before use, each layer's blob (and its unpacked tar against the config's
  ``rootfs.diff_ids``) while it streams; JSON documents are bounded in size.
- A ``docker save`` image has no manifest blob; it gets a canonical OCI
  manifest built from its config digest and diff_ids (sorted-key JSON), so the
  same tarball always gets the same digest.
- Paths taken from the input (docker's manifest.json, archive symlinks) are
  relative and never climb out; blob paths are built from validated digests.
- Only linux images of this host's architecture are accepted.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import stat
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from supervisor.images.errors import DigestMismatch, ImageFormatError, LimitExceeded
from supervisor.images.unpack import BoundedTarInfo

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
_INDEXES = (OCI_INDEX, DOCKER_LIST)
_MANIFESTS = (OCI_MANIFEST, DOCKER_MANIFEST)
_LAYER_TYPES = (
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.docker.image.rootfs.diff.tar",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
)
_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le",
         "s390x": "s390x", "riscv64": "riscv64"}


def host_arch() -> str:
    m = platform.machine()
    return _ARCH.get(m, m)


@dataclass(frozen=True)
class LayerRef:
    """One layer: ``label`` names it in errors (its digest); ``digest``/``size``
    are the blob's (None for docker save, whose layer files have none);
    ``diff_id`` is the unpacked tar's digest."""

    label: str
    open: Callable[[], IO[bytes]]
    digest: str | None
    size: int | None
    diff_id: str | None


@dataclass(frozen=True)
class Image:
    kind: str  # "oci-layout" | "oci-archive" | "docker-archive"
    manifest: bytes
    digest: str
    config: bytes
    config_doc: dict[str, Any]
    layers: list[LayerRef]


class _Container:
    """Files of a layout or docker save, in a directory or a tar."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tar: tarfile.TarFile | None = None
        self._members: dict[str, tarfile.TarInfo] = {}
        if path.is_dir():
            return
        try:
            self._tar = tarfile.open(path, "r:*",  # noqa: SIM115 - closed by close()
                                     tarinfo=BoundedTarInfo)
            for m in self._tar.getmembers():
                self._members[_norm(m.name)] = m
        except (tarfile.TarError, EOFError, OSError) as exc:
            self.close()
            raise ImageFormatError(f"{path}: not a readable image tarball, or truncated "
                                   f"({exc}); give an OCI layout directory, an OCI archive "
                                   "or a 'docker save' tarball") from exc

    @property
    def is_tar(self) -> bool:
        return self._tar is not None

    def has(self, rel: str) -> bool:
        if self._tar is None:
            return (self.path / rel).is_file()
        return _norm(rel) in self._members

    def open(self, rel: str) -> IO[bytes]:
        parts = [p for p in rel.split("/") if p not in ("", ".")]
        if rel.startswith("/") or ".." in parts:
            raise ImageFormatError(f"{self.path}: refers to {rel!r}, outside the image")
        if self._tar is None:
            try:
                # O_NONBLOCK: a fifo put where a blob should be must not hang the
                # import at open (with no writer it reads as empty: a short blob);
                # anything but a regular file or a fifo is refused.
                fd = os.open(self.path / "/".join(parts),
                             os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as exc:
                raise ImageFormatError(f"{self.path}: cannot read {rel} ({exc.strerror}); the "
                                       "image is incomplete") from exc
            mode = os.fstat(fd).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
                os.close(fd)
                raise ImageFormatError(f"{self.path}: {rel} is not a regular file (a device, "
                                       "a socket or a directory); the image is refused")
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb")
        name = "/".join(parts)
        for _hop in range(8):
            m = self._members.get(name)
            if m is None:
                break
            if m.issym():  # docker save links repeated layers: resolve inside the archive
                base = name.split("/")[:-1]
                for p in m.linkname.split("/"):
                    if p == "..":
                        if not base:
                            break
                        base.pop()
                    elif p not in ("", "."):
                        base.append(p)
                else:
                    name = "/".join(base)
                    continue
                break
            f = self._tar.extractfile(m)
            if f is not None:
                return f
            break
        raise ImageFormatError(f"{self.path}: holds no file {rel}; the image is incomplete")

    def read_json(self, rel: str, limit: int, digest: str | None = None) -> tuple[bytes, Any]:
        with self.open(rel) as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise LimitExceeded(f"{self.path}: {rel} is over {limit} bytes")
        if digest is not None:
            got = "sha256:" + hashlib.sha256(data).hexdigest()
            if got != digest:
                raise DigestMismatch(f"{self.path}: {rel} has digest {got}, not {digest}; the "
                                     "image is corrupt or was tampered with")
        try:
            return data, json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ImageFormatError(f"{self.path}: {rel} is not JSON ({exc})") from exc

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()
            self._tar = None


def _opener(c: _Container, rel: str) -> Callable[[], IO[bytes]]:
    return lambda: c.open(rel)


def _norm(name: str) -> str:
    return "/".join(p for p in name.split("/") if p not in ("", "."))


def _blob(digest: Any, where: str) -> str:
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise ImageFormatError(f"{where}: {digest!r} is not a sha256 digest (only sha256 "
                               "is supported)")
    return "blobs/sha256/" + digest[len("sha256:"):]


class ImageReader:
    """Opens ``path`` and reads its image; ``close`` releases the input."""

    def __init__(self, path: Path, max_json_bytes: int) -> None:
        if not path.exists():
            raise ImageFormatError(f"{path}: no such file or directory; give an OCI layout "
                                   "directory, an OCI archive or a 'docker save' tarball")
        self._c = _Container(path)
        self._limit = max_json_bytes

    def close(self) -> None:
        self._c.close()

    def read(self) -> Image:
        c = self._c
        if c.has("index.json"):
            return self._oci("oci-archive" if c.is_tar else "oci-layout")
        if c.has("manifest.json"):
            return self._docker()
        raise ImageFormatError(f"{c.path}: has neither index.json (OCI layout) nor "
                               "manifest.json (docker save); give an OCI layout directory, "
                               "an OCI archive or a 'docker save' tarball")

    # -- OCI ---------------------------------------------------------------

    def _oci(self, kind: str) -> Image:
        c = self._c
        _, index = c.read_json("index.json", self._limit)
        desc = self._pick(index, "index.json")
        for _depth in range(2):
            if desc.get("mediaType") not in _INDEXES:
                break
            _, nested = c.read_json(_blob(desc.get("digest"), "index"), self._limit,
                                    desc["digest"])
            desc = self._pick(nested, f"index {desc['digest']}")
        digest = desc.get("digest")
        raw, manifest = c.read_json(_blob(digest, "index.json"), self._limit, digest)
        if not isinstance(manifest, dict) or manifest.get("schemaVersion") != 2:
            raise ImageFormatError(f"manifest {digest}: not an image manifest (schemaVersion 2)")
        mt = manifest.get("mediaType", desc.get("mediaType", OCI_MANIFEST))
        if mt not in _MANIFESTS:
            raise ImageFormatError(f"manifest {digest}: media type {mt!r} is not an image "
                                   "manifest")
        cdesc = manifest.get("config")
        if not isinstance(cdesc, dict):
            raise ImageFormatError(f"manifest {digest}: has no config")
        craw, config = c.read_json(_blob(cdesc.get("digest"), "config"), self._limit,
                                   cdesc["digest"])
        diff_ids = self._check_config(config, f"manifest {digest}")
        ldescs = manifest.get("layers")
        if not isinstance(ldescs, list) or not ldescs:
            raise ImageFormatError(f"manifest {digest}: an image with no layers; nothing to "
                                   "unpack")
        if diff_ids is not None and len(diff_ids) != len(ldescs):
            raise ImageFormatError(f"manifest {digest}: {len(ldescs)} layers but the config "
                                   f"lists {len(diff_ids)} diff_ids")
        layers = []
        for i, ld in enumerate(ldescs):
            if not isinstance(ld, dict):
                raise ImageFormatError(f"manifest {digest}: layer {i} is not a descriptor")
            lmt = ld.get("mediaType", "")
            if "zstd" in lmt:
                raise ImageFormatError(f"layer {ld.get('digest')}: zstd-compressed layers are "
                                       "not supported (gzip and uncompressed are); convert with "
                                       "'skopeo copy --dest-compress-format gzip'")
            if lmt not in _LAYER_TYPES:
                raise ImageFormatError(f"layer {ld.get('digest')}: media type {lmt!r} is not "
                                       "supported (tar or tar+gzip layers)")
            path = _blob(ld.get("digest"), f"layer {i}")
            size = ld.get("size")
            if not isinstance(size, int) or size < 0:
                raise ImageFormatError(f"layer {ld['digest']}: the descriptor has no size")
            layers.append(LayerRef(label=ld["digest"], open=_opener(c, path),
                                   digest=ld["digest"], size=size,
                                   diff_id=diff_ids[i] if diff_ids else None))
        return Image(kind, raw, str(digest), craw, config, layers)

    def _pick(self, index: Any, where: str) -> dict[str, Any]:
        ms = index.get("manifests") if isinstance(index, dict) else None
        if not isinstance(ms, list) or not ms:
            raise ImageFormatError(f"{where}: lists no manifests; an image with nothing in it")
        want = ("linux", host_arch())
        seen = []
        fits = []
        for d in ms:
            if not isinstance(d, dict):
                continue
            p = d.get("platform")
            if p is None:
                fits.append(d)
                continue
            seen.append(f"{p.get('os')}/{p.get('architecture')}")
            if (p.get("os"), p.get("architecture")) == want:
                fits.append(d)
        if not fits:
            raise ImageFormatError(f"{where}: no manifest for {'/'.join(want)} (it has "
                                   f"{', '.join(seen) or 'none'}); import an image built for "
                                   "this platform")
        if len(fits) > 1:
            raise ImageFormatError(f"{where}: holds {len(fits)} images for this platform; "
                                   "import a layout with one image")
        return fits[0]

    def _check_config(self, config: Any, where: str) -> list[str] | None:
        if not isinstance(config, dict):
            raise ImageFormatError(f"{where}: the config is not a JSON object")
        os_, arch = config.get("os"), config.get("architecture")
        if (os_ is not None and os_ != "linux") or (arch is not None and arch != host_arch()):
            raise ImageFormatError(f"{where}: the image is for {os_}/{arch}, this host runs "
                                   f"linux/{host_arch()}; import an image built for it")
        rootfs = config.get("rootfs")
        ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
        if ids is None:
            return None
        if not isinstance(ids, list):
            raise ImageFormatError(f"{where}: rootfs.diff_ids is not a list")
        for d in ids:
            _blob(d, f"{where}: diff_id")
        return [str(d) for d in ids]

    # -- docker save -------------------------------------------------------

    def _docker(self) -> Image:
        c = self._c
        _, doc = c.read_json("manifest.json", self._limit)
        if not isinstance(doc, list) or len(doc) != 1 or not isinstance(doc[0], dict):
            n = len(doc) if isinstance(doc, list) else 0
            raise ImageFormatError(f"{c.path}: manifest.json lists {n} images; save one "
                                   "image per tarball ('docker save IMAGE')")
        entry = doc[0]
        cpath = entry.get("Config")
        if not isinstance(cpath, str):
            raise ImageFormatError(f"{c.path}: manifest.json names no Config")
        stem = cpath.split("/")[-1].removesuffix(".json")
        expect = f"sha256:{stem}" if re.fullmatch(r"[0-9a-f]{64}", stem) else None
        craw, config = c.read_json(cpath, self._limit, expect)
        diff_ids = self._check_config(config, f"{c.path}: config")
        paths = entry.get("Layers")
        if not isinstance(paths, list) or not paths:
            raise ImageFormatError(f"{c.path}: an image with no layers; nothing to unpack")
        if diff_ids is None or len(diff_ids) != len(paths):
            raise ImageFormatError(f"{c.path}: the config's rootfs.diff_ids do not match the "
                                   f"{len(paths)} layers; the tarball is corrupt")
        layers = []
        for p, did in zip(paths, diff_ids, strict=True):
            if not isinstance(p, str):
                raise ImageFormatError(f"{c.path}: a layer path is not a string")
            layers.append(LayerRef(label=did, open=_opener(c, p), digest=None,
                                   size=None, diff_id=did))
        cdigest = "sha256:" + hashlib.sha256(craw).hexdigest()
        manifest = {
            "schemaVersion": 2, "mediaType": OCI_MANIFEST,
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": cdigest, "size": len(craw)},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d}
                       for d in diff_ids],
        }
        raw = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
        return Image("docker-archive", raw, "sha256:" + hashlib.sha256(raw).hexdigest(),
                     craw, config, layers)
