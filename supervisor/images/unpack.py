"""Apply OCI image layers (tar streams) to a root directory, safely against
hostile layers.

Invariants:
- Nothing is resolved through a symlink. Every path is walked one component
  at a time from the root's directory fd with ``O_NOFOLLOW | O_DIRECTORY``;
  an entry whose parent path crosses a symlink or a non-directory is refused.
  Files are created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` after whatever was
  there is removed, so a write never lands through a link (soft or hard).
- Entry names and hard-link targets are relative, without ``..``; a hard link's
  target must already be in the root (an earlier entry or layer) and not be a
  directory. A relative symlink target may not climb above the root, counted
  from the link's own directory; an absolute target is kept as written: it
  names a path in the image's own root once that root is ``/``, and the store
  never follows it.
- Extended headers over ``MAX_HEADER_BYTES`` and sparse files are refused
  before tarfile reads them into memory (``BoundedTarInfo``).
- Device nodes and fifos are refused; setuid/setgid bits are refused unless
  ``allow_setuid``. Ownership is not kept (the importer owns every file).
- Whiteouts follow the OCI image spec: ``.wh.NAME`` removes NAME of lower
  layers, ``.wh..wh..opq`` empties its directory of lower layers' entries;
  neither hides what the same layer writes.
- Every layer and the whole image are bounded (``Limits``): entries, bytes,
  path depth. Refusals raise ``UnsafeEntry`` / ``LimitExceeded`` naming the
  layer and entry; the caller discards the partial root.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass

from supervisor.images.errors import LimitExceeded, UnsafeEntry

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# A tar's extended headers (pax, GNU long name/link) are read whole into memory
# by tarfile, before any member reaches us: each is bounded here (BoundedTarInfo).
MAX_HEADER_BYTES = 1 << 20
_EXTENDED = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE,
             tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE)
_CHUNK = 1 << 20
OPAQUE = ".wh..wh..opq"
WHITEOUT = ".wh."

Parts = tuple[str, ...]


class HeaderTooLarge(tarfile.TarError):
    """An extended header over ``MAX_HEADER_BYTES``. Not a ``tarfile.HeaderError``:
    tarfile reads one of those past the first member as the archive's end."""


class BoundedTarInfo(tarfile.TarInfo):
    """A ``TarInfo`` that refuses an extended header (pax, GNU long name or
    link) over ``MAX_HEADER_BYTES`` before tarfile reads it into memory: a
    gzip layer of a few MB held a 'long name' of gigabytes, which the
    importer allocated whole (``tarfile.open(..., tarinfo=BoundedTarInfo)``)."""

    def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _EXTENDED and self.size > MAX_HEADER_BYTES:
            raise HeaderTooLarge(f"an extended header (type {self.type!r}) of {self.size} "
                                 f"bytes, above {MAX_HEADER_BYTES}")
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise _sparse()
        return super()._proc_member(tar)  # type: ignore[misc,no-any-return]

    # Sparse files: tarfile keeps their maps in memory, 2.5 KB of Python
    # objects per 512-byte block of the map, as many blocks as the layer
    # holds; image builders write none. Refused, in every form.
    def _proc_gnusparse_00(self, *_: object) -> None:
        raise _sparse()

    def _proc_gnusparse_01(self, *_: object) -> None:
        raise _sparse()

    def _proc_gnusparse_10(self, *_: object) -> None:
        raise _sparse()


def _sparse() -> HeaderTooLarge:
    return HeaderTooLarge("a sparse file (GNU sparse formats are not supported in images: "
                          "tarfile would hold its whole map in memory)")


@dataclass(frozen=True)
class Limits:
    """Bounds on one import. Bytes are the layer's unpacked file bytes (and,
    separately, its blob as stored); ``max_total_bytes`` sums every layer."""

    max_layers: int = 128
    max_layer_entries: int = 500_000
    max_layer_bytes: int = 8 << 30
    max_total_bytes: int = 32 << 30
    max_path_depth: int = 128
    max_link_target: int = 4096
    max_json_bytes: int = 4 << 20


class RootApplier:
    """Applies layers, in order, to the directory open at ``root_fd``."""

    def __init__(self, root_fd: int, limits: Limits, *, allow_setuid: bool = False) -> None:
        self._root_fd = root_fd
        self._limits = limits
        self._allow_setuid = allow_setuid
        self._dir_modes: dict[Parts, int] = {}
        self.total_bytes = 0
        self.total_entries = 0

    def apply(self, layer: str, members: Iterable[tarfile.TarInfo], tar: tarfile.TarFile) -> None:
        """Apply one layer's members (a streaming tar: each member's data is
        read from ``tar`` before the next member)."""
        created: set[Parts] = set()
        entries = 0
        layer_bytes = 0
        for m in members:
            entries += 1
            if entries > self._limits.max_layer_entries:
                raise LimitExceeded(
                    f"layer {layer}: more than {self._limits.max_layer_entries} entries; "
                    "the image is refused (raise --max-layer-entries if it is trusted)")
            parts = self._parts(layer, m.name, m.name, "entry")
            if m.isreg():
                layer_bytes += m.size
                self.total_bytes += m.size
                self._check_bytes(layer, m.name, layer_bytes)
            try:
                self._entry(layer, m, parts, tar, created)
            except OSError as exc:
                raise UnsafeEntry(layer, m.name, f"cannot be written ({exc.strerror})") from exc
            for i in range(1, len(parts) + 1):
                created.add(parts[:i])
        self.total_entries += entries

    def finish(self) -> None:
        """Give directories their modes, deepest first (a 0555 parent must not
        stop its children from being written, nor a 0000 one from being reached)."""
        for parts in sorted(self._dir_modes, key=len, reverse=True):
            try:
                fd = self._walk("", "", parts, create=False)
            except UnsafeEntry:
                continue  # replaced by a file or link in a later layer
            if fd is None:
                continue  # removed by a later whiteout
            try:
                os.fchmod(fd, self._dir_modes[parts])
            finally:
                os.close(fd)

    # -- one entry ---------------------------------------------------------

    def _entry(self, layer: str, m: tarfile.TarInfo, parts: Parts, tar: tarfile.TarFile,
               created: set[Parts]) -> None:
        if not parts:
            if not m.isdir():
                raise UnsafeEntry(layer, m.name, "the root is not a directory")
            self._dir_modes[()] = self._mode(layer, m)
            return
        base = parts[-1]
        if base.startswith(WHITEOUT):
            self._whiteout(layer, m.name, parts, created)
            return
        if m.ischr() or m.isblk() or m.isfifo():
            raise UnsafeEntry(layer, m.name, "device nodes and fifos are not allowed in images")
        if not (m.isreg() or m.isdir() or m.issym() or m.islnk()):
            raise UnsafeEntry(layer, m.name, f"unsupported tar entry type {m.type!r}")
        mode = self._mode(layer, m)
        parent = self._walk(layer, m.name, parts[:-1], create=True)
        assert parent is not None  # create=True never returns None
        try:
            if m.isdir():
                st = _lstat(parent, base)
                if st is not None and not stat.S_ISDIR(st.st_mode):
                    _remove(parent, base)
                    st = None
                if st is None:
                    os.mkdir(base, 0o700, dir_fd=parent)
                self._dir_modes[parts] = mode
            elif m.isreg():
                self._file(layer, m, parent, base, mode, tar)
            elif m.issym():
                self._check_symlink(layer, m.name, parts, m.linkname)
                _remove(parent, base)
                os.symlink(m.linkname, base, dir_fd=parent)
                os.utime(base, (m.mtime, m.mtime), dir_fd=parent, follow_symlinks=False)
            else:
                self._hardlink(layer, m, parts, parent, base)
        finally:
            os.close(parent)

    def _file(self, layer: str, m: tarfile.TarInfo, parent: int, base: str, mode: int,
              tar: tarfile.TarFile) -> None:
        _remove(parent, base)
        fd = os.open(base, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=parent)
        try:
            src = tar.extractfile(m)
            written = 0
            if src is not None:
                while chunk := src.read(_CHUNK):
                    written += len(chunk)
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view):]
            if written != m.size:
                raise UnsafeEntry(layer, m.name, f"holds {written} bytes, its header says "
                                  f"{m.size} (a truncated layer)")
            os.fchmod(fd, mode)
            os.utime(fd, (m.mtime, m.mtime))
        finally:
            os.close(fd)

    def _hardlink(self, layer: str, m: tarfile.TarInfo, parts: Parts, parent: int,
                  base: str) -> None:
        target = self._parts(layer, m.name, m.linkname, "hard link target")
        if not target:
            raise UnsafeEntry(layer, m.name, "a hard link to the root directory")
        if target == parts:
            raise UnsafeEntry(layer, m.name, "a hard link to itself")
        tparent = self._walk(layer, m.name, target[:-1], create=False)
        if tparent is None:
            raise UnsafeEntry(layer, m.name, f"hard link target {m.linkname!r} is not in the "
                              "image (hard links may only name earlier entries)")
        try:
            st = _lstat(tparent, target[-1])
            if st is None:
                raise UnsafeEntry(layer, m.name, f"hard link target {m.linkname!r} is not in "
                                  "the image (hard links may only name earlier entries)")
            if stat.S_ISDIR(st.st_mode):
                raise UnsafeEntry(layer, m.name, "a hard link to a directory")
            _remove(parent, base)
            os.link(target[-1], base, src_dir_fd=tparent, dst_dir_fd=parent,
                    follow_symlinks=False)
        finally:
            os.close(tparent)

    def _whiteout(self, layer: str, name: str, parts: Parts, created: set[Parts]) -> None:
        parent = self._walk(layer, name, parts[:-1], create=False)
        if parent is None:
            return  # nothing below to hide
        try:
            if parts[-1] == OPAQUE:
                self._clear_lower(parent, parts[:-1], created)
                return
            hidden = parts[-1][len(WHITEOUT):]
            if hidden in ("", ".", "..") or "/" in hidden:
                raise UnsafeEntry(layer, name, "a whiteout that names no entry")
            if (*parts[:-1], hidden) not in created:
                _remove(parent, hidden)
        finally:
            os.close(parent)

    def _clear_lower(self, dir_fd: int, at: Parts, created: set[Parts]) -> None:
        """Remove every entry under ``at`` that this layer did not write."""
        with os.scandir(dir_fd) as it:
            names = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        for name, is_dir in names:
            child = (*at, name)
            if child not in created:
                _remove(dir_fd, name)
            elif is_dir:
                fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
                try:
                    self._clear_lower(fd, child, created)
                finally:
                    os.close(fd)

    # -- checks ------------------------------------------------------------

    def _parts(self, layer: str, entry: str, name: str, what: str) -> Parts:
        if "\x00" in name:
            raise UnsafeEntry(layer, entry, f"{what} holds a NUL byte")
        if name.startswith("/"):
            raise UnsafeEntry(layer, entry, f"{what} is an absolute path")
        parts = tuple(p for p in name.split("/") if p not in ("", "."))
        if ".." in parts:
            raise UnsafeEntry(layer, entry, f"{what} climbs out with '..' (path traversal)")
        if len(parts) > self._limits.max_path_depth:
            raise UnsafeEntry(layer, entry, f"{what} is deeper than "
                              f"{self._limits.max_path_depth} directories")
        return parts

    def _check_symlink(self, layer: str, entry: str, parts: Parts, target: str) -> None:
        if not target or "\x00" in target or len(target) > self._limits.max_link_target:
            raise UnsafeEntry(layer, entry, "a symlink with an empty, NUL or overlong target")
        if target.startswith("/"):
            return  # the image's own root once it is '/'; never followed here
        depth = len(parts) - 1
        for p in target.split("/"):
            if p in ("", "."):
                continue
            depth += -1 if p == ".." else 1
            if depth < 0:
                raise UnsafeEntry(layer, entry, f"symlink to {target!r} leads out of the "
                                  "image root")

    def _mode(self, layer: str, m: tarfile.TarInfo) -> int:
        mode = m.mode & 0o7777
        if mode & (stat.S_ISUID | stat.S_ISGID) and not self._allow_setuid:
            raise UnsafeEntry(layer, m.name, f"mode {mode:04o} has the setuid or setgid bit "
                              "(pass --allow-setuid to import it anyway)")
        return mode

    def _check_bytes(self, layer: str, entry: str, layer_bytes: int) -> None:
        lim = self._limits
        if layer_bytes > lim.max_layer_bytes:
            raise LimitExceeded(f"layer {layer}: entry {entry!r} takes it over "
                                f"{lim.max_layer_bytes} unpacked bytes; the image is refused "
                                "(raise --max-layer-bytes if it is trusted)")
        if self.total_bytes > lim.max_total_bytes:
            raise LimitExceeded(f"layer {layer}: entry {entry!r} takes the image over "
                                f"{lim.max_total_bytes} unpacked bytes; the image is refused "
                                "(raise --max-total-bytes if it is trusted)")

    def _walk(self, layer: str, entry: str, parts: Parts, *, create: bool) -> int | None:
        """An fd of the directory ``parts`` under the root, never through a
        symlink; missing directories are made (``create``) or give None."""
        fd = os.dup(self._root_fd)
        try:
            for i, p in enumerate(parts):
                try:
                    nfd = os.open(p, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        os.close(fd)
                        return None
                    os.mkdir(p, 0o755, dir_fd=fd)
                    self._dir_modes[parts[:i + 1]] = 0o755  # not an earlier one's mode
                    nfd = os.open(p, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    raise UnsafeEntry(layer, entry, f"its parent {'/'.join(parts[:i + 1])!r} is "
                                      "a symlink or not a directory (paths are never resolved "
                                      "through links)") from exc
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        return fd


def _lstat(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return None


def _remove(dir_fd: int, name: str) -> None:
    """Remove ``name`` (any type, directories recursively) without following links."""
    st = _lstat(dir_fd, name)
    if st is None:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    remove_tree_at(dir_fd, name)


def remove_tree_at(dir_fd: int, name: str) -> None:
    """Remove the directory ``name`` and everything in it, never following a
    link; directories are made writable first (an image may hold 0555 ones).
    What vanishes meanwhile (another process sweeping the same tree) is fine."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    try:
        os.fchmod(fd, 0o700)
        with os.scandir(fd) as it:
            children = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        for child, is_dir in children:
            if is_dir:
                remove_tree_at(fd, child)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(child, dir_fd=fd)
    finally:
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(name, dir_fd=dir_fd)
