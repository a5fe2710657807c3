"""``openat2``: path resolution the kernel confines, for the worker and the file tools.

Python has no binding for ``openat2`` (syscall 437 on x86-64 and aarch64), so
it is called through ctypes. ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
RESOLVE_NO_MAGICLINKS`` (``RESOLVE``) makes the kernel refuse ``..`` escapes,
absolute paths and any symlink on the way, atomically: there is no
check-then-open window for a sandboxed process to race.

Invariants:
- ``openat2`` always adds ``O_CLOEXEC``; a mode is passed only with
  ``O_CREAT``/``O_TMPFILE`` (the kernel refuses it otherwise).
- Errors are ``OSError`` with the kernel's errno; callers translate them.
"""

from __future__ import annotations

import ctypes
import os
from typing import Final

SYS_OPENAT2: Final = 437  # new syscalls share one number across architectures
AT_FDCWD: Final = -100
RESOLVE_NO_MAGICLINKS: Final = 0x02
RESOLVE_NO_SYMLINKS: Final = 0x04
RESOLVE_BENEATH: Final = 0x08
RESOLVE: Final = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


def openat2(dirfd: int, path: str, flags: int, mode: int = 0, resolve: int = RESOLVE) -> int:
    """The raw openat2 syscall; raises OSError."""
    if not flags & (os.O_CREAT | os.O_TMPFILE):
        mode = 0
    how = _OpenHow(flags=flags | os.O_CLOEXEC, mode=mode, resolve=resolve)
    fd = _libc.syscall(SYS_OPENAT2, ctypes.c_int(dirfd), os.fsencode(path),
                       ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return int(fd)
