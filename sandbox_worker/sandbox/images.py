"""Image roots on a worker: the images tool calls run over (docs/images.md).

A worker reads the image store's on-disk layout (written by
``supervisor/images/store.py``; the contract is ``STORE_LAYOUT`` below) from
``--images DIR`` (the farm's ``HOME/images``, or a local cache), and may fetch
an image it lacks from ``--image-source DIR`` (the farm's store on shared
storage): the image's directory is copied into ``DIR/tmp/`` and renamed into
place only after it verified.

Opening an image for a call (``ImageRoots.open``) verifies, on disk, every
time: the sha256 of ``manifest.json`` is the digest asked for; the sha256 of
``config.json`` is the manifest's config digest; the root directory's tree
digest (``sandbox_worker.api.rootfs_digest``) is ``image.json``'s
``rootfs_sha256``. The tree walk is done once per worker for a root
directory identity (device, inode, ctime); later calls compare the identity.
The root is handed on as the verified directory's fd: the call's layer
(``overlay.py``) uses that fd as its lower layer, never the path again.

Invariants:
- A missing, unreadable or unverifiable image is a ``ToolError``
  (``image_unavailable`` / ``image_unverified``): a call never runs on
  another root, and never on the host's.
- Nothing here follows a symlink inside an image: every open is relative to
  a directory fd with ``O_NOFOLLOW``, or ``openat2`` with
  ``RESOLVE_IN_ROOT`` (the image's own links resolved inside its root).
- Reads are bounded (``MAX_DOC_BYTES`` for the JSON documents and passwd).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import posixpath
import secrets
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from sandbox_worker.api import IMAGE_DIGEST_RE, IMAGE_SERVICES, ImageRecord, rootfs_digest
from sandbox_worker.sandbox.errors import ToolError
from sandbox_worker.sandbox.overlay import close_worker_dir, mount_layer, sweep
from sandbox_worker.sandbox.resolve import RESOLVE_NO_MAGICLINKS, openat2

log = logging.getLogger(__name__)

STORE_LAYOUT: Final = "sha256/HEX/{manifest.json,config.json,image.json,rootfs/}"
MAX_DOC_BYTES: Final = 4 << 20
RESOLVE_IN_ROOT: Final = 0x10
# Where the workspace goes when the image names no (usable) WorkingDir, and
# paths the chain mounts over (a WorkingDir there would be hidden).
DEFAULT_WORKDIR: Final = "/workspace"
RESERVED: Final = ("/proc", "/dev", "/tmp", "/sys", "/run/corral")
# Environment the chain sets itself; an image's Env cannot replace these.
OWN_ENV: Final = ("CORRAL_SANDBOX", "CORRAL_CALL_ID", "GIT_CONFIG_COUNT", "GIT_CONFIG_KEY_0",
                  "GIT_CONFIG_VALUE_0", "TMPDIR")


class ImageUnavailable(ToolError):
    kind = "image_unavailable"


class ImageUnverified(ToolError):
    kind = "image_unverified"


@dataclass
class ImageRoot:
    """One verified image, open for one call (``close`` it)."""

    digest: str
    rootfs_sha256: str
    rootfs: str  # the root directory's path on this host
    identity: str  # "DEV:INO" of that directory, as verified
    fd: int  # the verified root directory (O_RDONLY|O_DIRECTORY)
    workdir: str
    env: dict[str, str]
    user: str
    home: str  # the image user's home (given to the call's uid), "" for none
    shell: str = "/bin/sh"  # what runs a string command: /bin/bash when the image has it
    has: frozenset[str] = frozenset()  # of the chain's mount points, those the image has

    def record(self) -> ImageRecord:
        return ImageRecord(digest=self.digest, rootfs_sha256=self.rootfs_sha256,
                           workdir=self.workdir, user=self.user, writable_layer="per-call")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _read_at(dfd: int, name: str, limit: int = MAX_DOC_BYTES) -> bytes:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{name} is not a regular file")
        data = b""
        while len(data) <= limit:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return data
            data += chunk
        raise OSError(f"{name} is over {limit} bytes")
    finally:
        os.close(fd)


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def clean_workdir(value: Any) -> str:
    """The image's WorkingDir if it is a usable absolute path, else /workspace."""
    if not isinstance(value, str) or not value.startswith("/"):
        return DEFAULT_WORKDIR
    norm = posixpath.normpath(value)
    if norm == "/" or ".." in norm.split("/") or any(
            norm == r or norm.startswith(r + "/") for r in RESERVED) or len(norm) > 1024:
        return DEFAULT_WORKDIR
    return norm


def plain_path(root_fd: int, path: str) -> bool:
    """Whether ``path`` (absolute, in the image) has no symlink or non-directory
    on its way: each component a directory, or missing (it is created in the
    call's layer). ``overlay.make_dir`` refuses the same, as root, when it
    makes them."""
    rel = path.strip("/")
    while rel:
        try:
            fd = openat2(root_fd, rel, os.O_PATH | os.O_DIRECTORY)
        except FileNotFoundError:
            rel = posixpath.dirname(rel)
            continue
        except OSError:
            return False  # a symlink (ELOOP) or not a directory on the way
        os.close(fd)
        return True
    return True


def _is_dir(root_fd: int, path: str) -> bool:
    """Whether ``path`` is a directory in the image (no symlink on the way)."""
    try:
        os.close(openat2(root_fd, path.strip("/") or ".", os.O_PATH | os.O_DIRECTORY))
    except OSError:
        return False
    return True


def _exists(root_fd: int, path: str) -> bool:
    """Whether ``path`` exists in the image, its links resolved inside its root."""
    try:
        os.close(openat2(root_fd, path, os.O_PATH, resolve=RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS))
    except OSError:
        return False
    return True


def user_home(root_fd: int, user: str) -> str:
    """The home directory of the image's ``User`` (a name or uid, maybe
    ``:group``) in the image's /etc/passwd, or "" (none, root, not found)."""
    name = user.partition(":")[0]
    if not name or name in ("0", "root"):
        return ""
    try:
        fd = openat2(root_fd, "etc/passwd", os.O_RDONLY,
                     resolve=RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
    except OSError:
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        text = os.read(fd, MAX_DOC_BYTES).decode("utf-8", errors="replace")
    finally:
        os.close(fd)
    for line in text.splitlines():
        parts = line.split(":")
        if len(parts) >= 7 and name in (parts[0], parts[2]) and parts[2] != "0":
            home = clean_workdir(parts[5])
            ok = home != DEFAULT_WORKDIR and plain_path(root_fd, home)
            return home if ok else ""
    return ""


def image_env(config: dict[str, Any]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in config.get("Env") or []:
        if isinstance(item, str) and "=" in item and "\0" not in item:
            key, _, value = item.partition("=")
            if key and key not in OWN_ENV and len(item) <= 65536:
                env[key] = value
    return env


@dataclass
class ImageRoots:
    """The images this worker can run calls over, and how it gets them."""

    store: str | None  # the store this worker reads (HOME/images or a cache)
    source: str | None = None  # a store on shared storage to fetch from
    enabled: bool = True
    overlay: bool = False  # whether a call's layer could be mounted here (``setup``)
    reason: str = ""
    _verified: dict[tuple[str, str], str] = field(default_factory=dict)

    # -- start-up ------------------------------------------------------------
    async def setup(self) -> None:
        """Try the call's layer for real (``overlay.mount_layer`` over a scratch
        directory, then detached): ``overlay`` says whether image calls can
        run here. Layers of dead workers are removed first."""
        if not self.enabled:
            self.reason = "images are switched off on this worker (--no-images)"
            return
        if self.store is None:
            self.reason = "no image store configured (--images DIR)"
            return
        swept = await asyncio.to_thread(sweep)
        if swept:
            log.info("removed the image layers of %d dead workers", swept)
        fd = -1
        lower = ""
        try:
            lower = await asyncio.to_thread(_scratch_lower)
            fd = os.open(lower, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            layer = await asyncio.to_thread(mount_layer, fd, 1 << 20, ["/proc", "/tmp"], "",
                                            0, 0)
            await asyncio.to_thread(layer.close)
            self.overlay = True
        except OSError as exc:
            self.reason = f"cannot mount an overlay for image calls here: {exc}"
        finally:
            if fd >= 0:
                os.close(fd)
            if lower:
                await asyncio.to_thread(shutil.rmtree, lower, True)

    async def aclose(self) -> None:
        """Detach this worker's layer directory (after its calls ended)."""
        if self.overlay:
            await asyncio.to_thread(close_worker_dir)

    def held(self) -> list[str]:
        """Digests of the images in this worker's store (installed ones only)."""
        if self.store is None:
            return []
        base = Path(self.store) / "sha256"
        try:
            names = sorted(os.listdir(base))
        except OSError:
            return []
        return [f"sha256:{n}" for n in names
                if IMAGE_DIGEST_RE.fullmatch(f"sha256:{n}") and (base / n / "image.json").is_file()]

    def info(self) -> dict[str, Any]:
        held = self.held() if self.overlay else []
        return {"overlay": self.overlay, "reason": self.reason, "store": self.store,
                "source": self.source, "held": held[:IMAGE_SERVICES],
                "held_count": len(held)}

    # -- per call ------------------------------------------------------------
    def open(self, digest: str) -> ImageRoot:
        """The verified image ``digest`` (fetched from ``source`` when this
        worker lacks it). Blocking: run it in a thread."""
        if not isinstance(digest, str) or not IMAGE_DIGEST_RE.fullmatch(digest):
            raise ImageUnavailable(f"the session's image {str(digest)[:80]!r} is not a "
                                   "sha256:HEX digest")
        if not self.overlay or self.store is None:
            raise ImageUnavailable(f"this worker cannot run tools in images: {self.reason}")
        hexd = digest.removeprefix("sha256:")
        path = os.path.join(self.store, "sha256", hexd)
        if not os.path.isdir(path):
            self._fetch(digest)
        try:
            dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise ImageUnavailable(f"image {digest} is not on this worker ({exc.strerror}); "
                                   "import it with 'corral image import'") from None
        try:
            return self._verify(dfd, digest, os.path.join(path, "rootfs"))
        finally:
            os.close(dfd)

    def _verify(self, dfd: int, digest: str, rootfs: str) -> ImageRoot:
        try:
            manifest_raw = _read_at(dfd, "manifest.json")
            config_raw = _read_at(dfd, "config.json")
            meta = json.loads(_read_at(dfd, "image.json"))
            manifest = json.loads(manifest_raw)
            config = json.loads(config_raw)
        except (OSError, ValueError) as exc:
            raise ImageUnverified(f"image {digest}: its documents are unreadable ({exc}); "
                                  "import it again") from None
        if _sha(manifest_raw) != digest:
            raise ImageUnverified(f"image {digest}: its manifest.json hashes to "
                                  f"{_sha(manifest_raw)}; the store copy is corrupt or was "
                                  "tampered with; import it again")
        want_config = (manifest.get("config") or {}).get("digest") if isinstance(
            manifest, dict) else None
        if _sha(config_raw) != want_config:
            raise ImageUnverified(f"image {digest}: its config.json does not match the "
                                  "manifest's config digest; import it again")
        tree = meta.get("rootfs_sha256") if isinstance(meta, dict) else None
        if not isinstance(tree, str) or not IMAGE_DIGEST_RE.fullmatch(tree):
            raise ImageUnverified(f"image {digest} has no recorded root tree digest (imported "
                                  "by an older version); import it again")
        try:
            rfd = os.open("rootfs", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                          dir_fd=dfd)
        except OSError as exc:
            raise ImageUnverified(f"image {digest}: its root is missing ({exc.strerror})"
                                  ) from None
        try:
            st = os.fstat(rfd)
            ident = f"{st.st_dev}:{st.st_ino}"
            key = (ident, str(st.st_ctime_ns))
            if self._verified.get(key) != tree:
                try:
                    seen = rootfs_digest(rfd)
                except (OSError, ValueError) as exc:
                    raise ImageUnverified(f"image {digest}: its root cannot be read ({exc})"
                                          ) from None
                if seen != tree:
                    raise ImageUnverified(f"image {digest}: its root tree hashes to {seen}, "
                                          f"the store recorded {tree}; it was changed after "
                                          "import; import it again")
                if len(self._verified) > 256:
                    self._verified.clear()
                self._verified[key] = tree
            body = config.get("config") if isinstance(config, dict) else None
            body = body if isinstance(body, dict) else {}
            user = str(body.get("User") or "")[:256]
            workdir = clean_workdir(body.get("WorkingDir"))
            if not plain_path(rfd, workdir):
                workdir = DEFAULT_WORKDIR  # a link on the way: never bound through it
            for mount_point in ("/proc", "/dev", "/tmp", workdir):
                if not plain_path(rfd, mount_point):
                    raise ImageUnavailable(f"image {digest}: {mount_point} goes through a "
                                           "symlink or a file in the image; the sandbox "
                                           "cannot mount there")
            root = ImageRoot(digest=digest, rootfs_sha256=tree, rootfs=rootfs, identity=ident,
                             fd=rfd, workdir=workdir,
                             env=image_env(body), user=user, home=user_home(rfd, user),
                             shell="/bin/bash" if _exists(rfd, "bin/bash") else "/bin/sh",
                             has=frozenset(p for p in ("/proc", "/dev", "/tmp", workdir)
                                           if _is_dir(rfd, p)))
        except BaseException:
            os.close(rfd)
            raise
        return root

    def _fetch(self, digest: str) -> None:
        """Copy image ``digest`` from the shared store into this worker's, then
        rename it in place; it is verified when opened."""
        hexd = digest.removeprefix("sha256:")
        src = os.path.join(self.source, "sha256", hexd) if self.source else None
        if src is None or not os.path.isdir(src):
            where = f" or in {self.source}" if self.source else ""
            raise ImageUnavailable(f"image {digest} is not in this worker's store "
                                   f"({self.store}){where}; import it there with "
                                   "'corral image import'")
        store = self.store
        if store is None:
            raise ImageUnavailable(f"image {digest}: this worker has no image store")
        tmp = os.path.join(store, "tmp", f"fetch-{secrets.token_hex(8)}")
        os.makedirs(os.path.join(store, "sha256"), 0o700, exist_ok=True)
        try:
            shutil.copytree(src, tmp, symlinks=True)
            with contextlib.suppress(OSError):  # another fetch may have won
                os.rename(tmp, os.path.join(store, "sha256", hexd))
        except OSError as exc:
            raise ImageUnavailable(f"image {digest}: fetching it from {self.source} failed "
                                   f"({exc})") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("fetched image %s from %s", digest, self.source)


def _scratch_lower() -> str:
    path = tempfile.mkdtemp(prefix="corral-overlay-check-")
    os.chmod(path, 0o755)
    return path
