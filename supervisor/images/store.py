"""The content-addressed image store under ``HOME/images/``.

Layout::

    images/lock                 flock: installs, removals and refs.json writes
    images/refs.json            {"NAME:TAG": "sha256:..."}
    images/sha256/HEX/          one image, HEX its manifest digest:
        manifest.json config.json image.json rootfs/
    images/tmp/ID/ + ID.lock    imports in progress (ID.lock flocked by its owner)

Invariants:
- An image directory appears only by one ``rename`` from ``tmp/`` after every
  blob verified and every layer unpacked; a refused or killed import leaves
  nothing under ``sha256/`` or in ``refs.json``. A later import removes
  ``tmp/`` entries whose lock no live process holds.
- Two imports of the same image unpack apart; the first rename wins and the
  other discards its copy. ``refs.json`` is replaced atomically under the lock.
- Images are named by manifest digest; names are only pointers to digests.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import hashlib
import io
import json
import logging
import os
import re
import secrets
import tarfile
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from sandbox_worker.api import rootfs_digest
from supervisor.images.errors import (
    DigestMismatch,
    ImageError,
    ImageFormatError,
    ImageNotFound,
    LimitExceeded,
)
from supervisor.images.source import Image, ImageReader, LayerRef
from supervisor.images.unpack import BoundedTarInfo, Limits, RootApplier, remove_tree_at

log = logging.getLogger(__name__)

_NAME = re.compile(r"[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class ImageInfo:
    digest: str
    names: list[str]
    size_bytes: int
    layers: int
    entries: int
    source: str
    imported_at: float


def parse_name(text: str) -> str:
    """``NAME[:TAG]`` -> ``NAME:TAG`` (tag ``latest`` by default)."""
    name, _, tag = text.rpartition(":") if ":" in text.split("/")[-1] else (text, "", "latest")
    if not _NAME.fullmatch(name) or not _TAG.fullmatch(tag):
        raise ImageFormatError(f"{text!r} is not an image name; use NAME[:TAG] with lowercase "
                               "letters, digits, '.', '_', '-' and '/' (e.g. tools/py:3.11)")
    return f"{name}:{tag}"


class _Hashing(io.RawIOBase):
    """Hashes and counts what is read through it; refuses past ``limit``."""

    def __init__(self, inner: IO[bytes] | io.BufferedIOBase, limit: int, what: str) -> None:
        self._inner = inner
        self._limit = limit
        self._what = what
        self.sha = hashlib.sha256()
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self._inner.read(len(b))
        n = len(data)
        self.count += n
        if self.count > self._limit:
            raise LimitExceeded(f"{self._what} is over {self._limit} bytes; the image is "
                                "refused (raise --max-layer-bytes if it is trusted)")
        self.sha.update(data)
        b[:n] = data
        return n

    def digest(self) -> str:
        return "sha256:" + self.sha.hexdigest()


def _drain(f: IO[bytes] | io.RawIOBase) -> None:
    while f.read(1 << 20):
        pass


class ImageStore:
    def __init__(self, home: Path, limits: Limits | None = None) -> None:
        self.root = home / "images"
        self.limits = limits or Limits()

    # -- reading -----------------------------------------------------------

    def list(self) -> list[ImageInfo]:
        refs = self._refs()
        out = []
        base = self.root / "sha256"
        for d in sorted(base.iterdir()) if base.is_dir() else []:
            info = self._info(f"sha256:{d.name}", refs)
            if info is not None:
                out.append(info)
        return out

    def resolve(self, ref: str) -> ImageInfo:
        """An image by ``sha256:HEX``, ``NAME[:TAG]`` or ``NAME@sha256:HEX``."""
        refs = self._refs()
        digest = ref.rpartition("@")[2] if "@" in ref else None
        if digest is None and _DIGEST.fullmatch(ref):
            digest = ref
        if digest is None:
            digest = refs.get(parse_name(ref))
        info = self._info(digest, refs) if digest and _DIGEST.fullmatch(digest) else None
        if info is None:
            raise ImageNotFound(f"no image {ref!r} in {self.root}; see 'corral image ls', "
                                "or import it with 'corral image import PATH --name NAME'")
        return info

    def rootfs(self, digest: str) -> Path:
        return self.root / "sha256" / digest.removeprefix("sha256:") / "rootfs"

    # -- import ------------------------------------------------------------

    def import_image(self, path: Path, name: str | None = None, *,
                     allow_setuid: bool = False,
                     on_layer: Callable[[int, str], None] | None = None) -> ImageInfo:
        tagged = parse_name(name) if name else None
        for d in ("sha256", "tmp"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        self._sweep_tmp()
        reader = ImageReader(path, self.limits.max_json_bytes)
        try:
            image = reader.read()
            if len(image.layers) > self.limits.max_layers:
                raise LimitExceeded(f"the image has {len(image.layers)} layers, over "
                                    f"{self.limits.max_layers}; the image is refused")
            final = self.root / "sha256" / image.digest.removeprefix("sha256:")
            if not final.is_dir():
                self._unpack_and_install(image, final, allow_setuid, on_layer)
        finally:
            reader.close()
        if tagged:
            with self._locked():
                refs = self._refs()
                refs[tagged] = image.digest
                self._write_refs(refs)
        info = self._info(image.digest, self._refs())
        if info is None:  # removed by a concurrent 'rm' between install and here
            raise ImageNotFound(f"image {image.digest} was removed while importing; import "
                                "it again")
        return info

    def _unpack_and_install(self, image: Image, final: Path, allow_setuid: bool,
                            on_layer: Callable[[int, str], None] | None) -> None:
        tid = secrets.token_hex(8)
        tmp = self.root / "tmp" / tid
        lock_fd = os.open(self.root / "tmp" / f"{tid}.lock",
                          os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            (tmp / "rootfs").mkdir(parents=True)
            root_fd = os.open(tmp / "rootfs", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                applier = RootApplier(root_fd, self.limits, allow_setuid=allow_setuid)
                for i, layer in enumerate(image.layers):
                    if on_layer is not None:
                        on_layer(i, layer.label)
                    self._apply_layer(applier, layer)
                applier.finish()
                os.fchmod(root_fd, 0o755)
                # What a worker checks before it binds this root (docs/images.md).
                tree = rootfs_digest(root_fd)
            finally:
                os.close(root_fd)
            (tmp / "manifest.json").write_bytes(image.manifest)
            (tmp / "config.json").write_bytes(image.config)
            meta = {"digest": image.digest, "size_bytes": applier.total_bytes,
                    "layers": len(image.layers), "entries": applier.total_entries,
                    "source": image.kind, "imported_at": time.time(),
                    "rootfs_sha256": tree}
            (tmp / "image.json").write_text(json.dumps(meta, sort_keys=True) + "\n")
            with self._locked():
                try:
                    os.rename(tmp, final)
                except OSError:
                    if not final.is_dir():
                        raise
                    log.info("image %s was installed by another import", image.digest)
        finally:
            if tmp.exists():
                _remove_tree(tmp)
            os.unlink(self.root / "tmp" / f"{tid}.lock")
            os.close(lock_fd)

    def _apply_layer(self, applier: RootApplier, layer: LayerRef) -> None:
        lim = self.limits
        what = f"layer {layer.label}"
        with layer.open() as raw:
            blob = _Hashing(raw, lim.max_layer_bytes, f"{what}'s blob")
            buf = io.BufferedReader(blob, 1 << 16)
            try:
                magic = buf.peek(4)[:4]
                if magic.startswith(b"\x28\xb5\x2f\xfd"):
                    raise ImageFormatError(f"{what}: zstd-compressed; only gzip and "
                                           "uncompressed layers are supported")
                dec: io.BufferedIOBase = (gzip.GzipFile(fileobj=buf, mode="rb")
                                  if magic.startswith(b"\x1f\x8b") else buf)
                plain = _Hashing(dec, lim.max_layer_bytes + (lim.max_layer_entries + 2) * 1536,
                                 f"{what} (unpacked)")
                with tarfile.open(fileobj=plain, mode="r|", tarinfo=BoundedTarInfo) as tar:
                    applier.apply(layer.label, tar, tar)
                _drain(plain)
                _drain(buf)
            except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
                raise ImageFormatError(f"{what}: truncated or corrupt ({exc}); the image is "
                                       "refused (nothing was installed)") from exc
        if layer.digest is not None and blob.digest() != layer.digest:
            raise DigestMismatch(f"{what}: its blob's sha256 is {blob.digest()}; the image is "
                                 "corrupt or was tampered with (nothing was installed)")
        if layer.size is not None and blob.count != layer.size:
            raise DigestMismatch(f"{what}: its blob holds {blob.count} bytes, the manifest "
                                 f"says {layer.size} (nothing was installed)")
        if layer.diff_id is not None and plain.digest() != layer.diff_id:
            raise DigestMismatch(f"{what}: its unpacked tar has sha256 {plain.digest()}, the "
                                 f"config says {layer.diff_id}; the image is corrupt or was "
                                 "tampered with (nothing was installed)")

    # -- remove ------------------------------------------------------------

    def remove(self, ref: str) -> dict[str, Any]:
        """Remove a name (the image goes with its last name) or, by digest,
        the image and every name of it."""
        info = self.resolve(ref)
        by_digest = _DIGEST.fullmatch(ref) is not None or "@" in ref
        with self._locked():
            refs = self._refs()
            gone = [n for n, d in refs.items() if d == info.digest
                    and (by_digest or n == parse_name(ref))]
            for n in gone:
                del refs[n]
            self._write_refs(refs)
            drop = info.digest not in refs.values()
            if drop:
                d = self.root / "sha256" / info.digest.removeprefix("sha256:")
                grave = self.root / "tmp" / f"rm-{secrets.token_hex(8)}"
                (self.root / "tmp").mkdir(exist_ok=True)
                os.rename(d, grave)  # disappears at once; deleted below
        if drop:
            _remove_tree(grave)
        return {"digest": info.digest, "untagged": gone, "removed": drop}

    # -- internals ---------------------------------------------------------

    def _info(self, digest: str | None, refs: dict[str, str]) -> ImageInfo | None:
        if digest is None:
            return None
        meta_path = self.root / "sha256" / digest.removeprefix("sha256:") / "image.json"
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            return None
        return ImageInfo(digest=digest, names=sorted(n for n, d in refs.items() if d == digest),
                         size_bytes=int(meta["size_bytes"]), layers=int(meta["layers"]),
                         entries=int(meta["entries"]), source=str(meta["source"]),
                         imported_at=float(meta["imported_at"]))

    def _refs(self) -> dict[str, str]:
        try:
            doc = json.loads((self.root / "refs.json").read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise ImageError(f"{self.root / 'refs.json'} is unreadable ({exc}); fix or "
                             "remove it (images stay, their names are lost)") from exc
        return {str(k): str(v) for k, v in doc.items()} if isinstance(doc, dict) else {}

    def _write_refs(self, refs: dict[str, str]) -> None:
        tmp = self.root / f"refs.json.{secrets.token_hex(4)}"
        tmp.write_text(json.dumps(refs, sort_keys=True, indent=1) + "\n")
        os.replace(tmp, self.root / "refs.json")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _sweep_tmp(self) -> None:
        """Remove what killed imports left in tmp/ (their lock is free)."""
        tmp = self.root / "tmp"
        for entry in tmp.iterdir():
            if entry.name.endswith(".lock"):
                continue
            lock = tmp / f"{entry.name}.lock"
            if entry.name.startswith("rm-"):
                _remove_tree(entry)
                continue
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                _remove_tree(entry)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue  # a live import
            try:
                _remove_tree(entry)
                lock.unlink(missing_ok=True)
            finally:
                os.close(fd)


def _remove_tree(path: Path) -> None:
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with contextlib.suppress(FileNotFoundError):
            remove_tree_at(fd, path.name)
    finally:
        os.close(fd)


def info_json(info: ImageInfo) -> dict[str, Any]:
    return asdict(info)
