"""Race-free workspace file access for the file tools, as the sandbox uid.

Every path is resolved with ``openat2(workspace_fd, path, RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)``: the kernel refuses ``..``
escapes, absolute paths and *any* symlink during the walk, atomically, so a
sandboxed process flipping an entry between a file and a symlink cannot make
a file tool open something outside (there is no check-then-open window).

The calls run in dedicated executor threads whose filesystem credentials are
the sandbox uid's (``setfsuid``/``setfsgid`` and an empty supplementary
group list, set per thread with raw syscalls; the kernel drops the DAC
capabilities of a thread whose fsuid is not 0). So file tools see the same
permissions as the shell tool, and files they create are owned by the
sandbox uid, exactly like files the shell creates.

Invariants:
- No path string is ever opened relative to the process cwd or root; only
  relative to a workspace fd (the worker's pinned one, duplicated per call).
- Regular files with more than one hard link are refused (a link may point
  outside the workspace); non-regular files are never opened for data.
- ``OSError`` is translated to ``ToolError`` subclasses here (``map_oserror``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import re
import stat
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Final, TypeVar

from sandbox_worker.sandbox.errors import (
    FileProblem,
    OutsideWorkspace,
    SandboxSetupError,
    ToolError,
)
from sandbox_worker.sandbox.resolve import RESOLVE, openat2

__all__ = ["RESOLVE", "SandboxFS", "check_relative", "make_parents", "map_oserror",
           "open_regular", "openat2"]

T = TypeVar("T")
SYS_SETGROUPS: Final = {"x86_64": 116, "aarch64": 159}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def check_relative(path: str) -> str:
    """Reject what is obviously outside before the kernel does, with a clear message."""
    if "\0" in path:
        raise OutsideWorkspace("path contains a NUL byte")
    if path.startswith("/"):
        raise OutsideWorkspace(f"{path!r} is absolute; use a path relative to the workspace")
    if ".." in path.split("/"):
        raise OutsideWorkspace(f"{path!r} contains '..'; paths must stay in the workspace")
    return path.strip("/") or "."


def display_name(name: str) -> tuple[str, bool]:
    """How a file name is shown to the model, and whether it had to be escaped.

    ``os.listdir``/``readlink`` give names as ``os.fsdecode`` does: a byte that
    is not UTF-8 becomes a lone surrogate (U+DC80..U+DCFF), which no UTF-8 text
    (the wire, the store, a provider) can carry. A name that is clean text is
    shown as it is. Otherwise every undecodable byte and control character is
    shown as ``\\xNN`` and a backslash as ``\\\\`` (as ``ls -b`` does), so the
    shown text is valid UTF-8 and names the bytes unambiguously."""
    if not _ODD_NAME.search(name):
        return name, False
    out = []
    for ch in name:
        code = ord(ch)
        if 0xDC80 <= code <= 0xDCFF:
            out.append(f"\\x{code - 0xDC00:02x}")
        elif code < 0x20 or code == 0x7F or 0xD800 <= code <= 0xDFFF:
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        elif ch == "\\":
            out.append("\\\\")
        else:
            out.append(ch)
    return "".join(out), True


_ODD_NAME: Final = re.compile("[\\x00-\\x1f\\x7f\\ud800-\\udfff]")


def map_oserror(exc: OSError, path: str) -> ToolError:
    code = exc.errno
    if code == errno.EXDEV:
        return OutsideWorkspace(f"{path!r} resolves outside the workspace")
    if code == errno.ELOOP:
        return OutsideWorkspace(f"{path!r} goes through a symlink; file tools do not "
                                "follow symlinks")
    kinds = {errno.ENOENT: "not_found", errno.EISDIR: "is_a_directory",
             errno.ENOTDIR: "not_a_directory", errno.EACCES: "permission_denied",
             errno.EPERM: "permission_denied", errno.EFBIG: "too_large",
             errno.ENOSPC: "no_space", errno.EDQUOT: "no_space", errno.EROFS: "read_only",
             errno.EEXIST: "exists", errno.ENXIO: "not_a_regular_file",
             errno.ETXTBSY: "busy", errno.ENAMETOOLONG: "name_too_long"}
    kind = kinds.get(code or 0, "file_error")
    return FileProblem(f"{path}: {exc.strerror or exc}", kind=kind)


def _become_sandbox(uid: int, gid: int) -> None:
    """Executor initializer: this thread's fs credentials become the sandbox's."""
    nr = SYS_SETGROUPS.get(platform.machine())
    if nr is None or _libc.syscall(nr, ctypes.c_size_t(0), None) != 0:
        raise OSError(ctypes.get_errno(), "setgroups in the file-tool thread failed")
    _libc.setfsgid(gid)
    _libc.setfsuid(uid)
    # setfs*id return the previous value and cannot fail loudly: read back.
    if _libc.setfsuid(-1) != uid or _libc.setfsgid(-1) != gid:
        raise OSError(errno.EPERM, "setfsuid/setfsgid did not take effect")


class SandboxFS:
    """Executor threads acting as the sandbox uid on workspace fds."""

    def __init__(self, uid: int, gid: int, threads: int = 2) -> None:
        if uid == 0:
            raise SandboxSetupError("file tools must not run with fsuid 0")
        self.uid = uid
        self.gid = gid
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="corral-fs",
                                        initializer=_become_sandbox, initargs=(uid, gid))

    @property
    def executor(self) -> ThreadPoolExecutor:
        return self._pool

    def run_as_group(self, gid: int, fn: Callable[[], T]) -> T:
        """Run ``fn`` in this (executor) thread with fsgid ``gid``: the group of
        the call's workspace (``sandbox/wsgroups.py``). Executor threads run
        only file tools, and each call sets its own group first."""
        if gid == 0:
            raise SandboxSetupError("file tools must not run with fsgid 0")
        _libc.setfsgid(gid)
        if _libc.setfsgid(-1) != gid:
            raise OSError(errno.EPERM, "setfsgid did not take effect")
        return fn()

    def whoami(self) -> tuple[int, int]:
        """(fsuid, fsgid) as seen from an executor thread (a start-up check)."""
        return self._pool.submit(lambda: (_libc.setfsuid(-1), _libc.setfsgid(-1))).result(10)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def open_workspace(workspace: int | str) -> int:
    """A new fd of the workspace for this call: a duplicate of the worker's
    pinned, identity-checked O_PATH fd (``sandbox/workspace.py``), so no path
    is resolved again and the workspace's parents need not be searchable. A
    path (tests, tools used on their own) is opened in the calling thread."""
    if isinstance(workspace, int):
        return os.dup(workspace)
    try:
        return os.open(workspace, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise FileProblem(f"workspace {workspace}: {exc.strerror}",
                          kind="workspace_unreachable") from exc


def open_regular(wsfd: int, path: str, flags: int, *, mode: int = 0o666) -> int:
    """Open a regular, singly-linked file beneath the workspace."""
    try:
        fd = openat2(wsfd, path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, mode)
    except OSError as exc:
        raise map_oserror(exc, path) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileProblem(f"{path} is not a regular file", kind="not_a_regular_file")
        if st.st_nlink > 1:
            raise FileProblem(f"{path} has {st.st_nlink} hard links; file tools refuse "
                              "hard-linked files (a link may lead outside the workspace)",
                              kind="hardlinked")
        # Back to blocking I/O for regular files.
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_parents(wsfd: int, path: str) -> None:
    """mkdir -p the parents of ``path`` beneath the workspace (no symlinks followed)."""
    parts = path.split("/")[:-1]
    for i in range(len(parts)):
        sub = "/".join(parts[: i + 1])
        parent = "/".join(parts[:i]) or "."
        try:
            pfd = openat2(wsfd, parent, os.O_PATH | os.O_DIRECTORY)
        except OSError as exc:
            raise map_oserror(exc, parent) from exc
        try:
            os.mkdir(parts[i], 0o777, dir_fd=pfd)
        except FileExistsError:
            pass
        except OSError as exc:
            raise map_oserror(exc, sub) from exc
        finally:
            os.close(pfd)
