"""The seccomp deny-list, compiled once per worker and handed out as fds.

Three filters are built from one list:

- ``bwrap``: the deny-list and the socket families a tool may use
  (``NET_FAMILIES``); bubblewrap loads it (``--seccomp FD``) just before it
  execs the command, after its own namespace set-up.
- ``t1``: the same deny-list plus "sockets only for AF_UNIX" (no network
  namespace at T1, and Landlock at ABI <= 7 does not stop UDP); the T1
  launcher loads it itself. ``t1_net`` (a network grant) allows
  ``NET_FAMILIES``.

Socket families: ``socket()`` with any family outside the allowed set fails
with ``EAFNOSUPPORT`` (what the kernel says for a family it lacks, so tools
handle it). ``NET_FAMILIES`` are AF_UNIX (local IPC), AF_INET and AF_INET6
(the network: loopback only in the namespace, the host's on a grant) and
AF_NETLINK with protocol NETLINK_ROUTE only (glibc's ``getaddrinfo`` with
AI_ADDRCONFIG, ``if_nameindex`` and ``ip`` need it; it sees the call's own
network namespace). Everything else -- AF_VSOCK (the hypervisor), AF_PACKET,
AF_BLUETOOTH, AF_ALG, AF_KEY, AF_XDP, other netlink protocols (audit,
uevents, netfilter, ...) -- is kernel attack surface no tool needs.

Invariants:
- Filters are compiled once (``SeccompFilters.compile``) and kept as sealed
  memfds; each call gets a fresh read-only descriptor at offset 0
  (``open_fd``) which the caller closes after spawning.
- The default action is ALLOW; listed calls fail with EPERM (clone3 with
  ENOSYS so libc falls back to clone, whose flags *can* be checked).
- No mode with S_ISUID or S_ISGID can be set: chmod, fchmod, fchmodat,
  fchmodat2, creat, mknod(at) and creating open/openat fail with EPERM for
  such a mode; openat2 (its mode is out of reach in a struct) with ENOSYS. Calls of
  a foreign architecture (i386 via int 0x80) hit libseccomp's bad-arch
  action, which kills the process.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Final

from sandbox_worker.sandbox.errors import SandboxSetupError

log = logging.getLogger(__name__)

DENIED_SYSCALLS: Final = (
    "ptrace", "process_vm_readv", "process_vm_writev",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "bpf", "perf_event_open", "userfaultfd",
    "keyctl", "add_key", "request_key",
    "unshare", "setns", "mount", "umount2", "pivot_root",
    "open_tree", "move_mount", "fsopen", "fsmount", "fsconfig", "fspick", "mount_setattr",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "acct", "swapon", "swapoff", "reboot", "syslog", "quotactl",
    "name_to_handle_at", "open_by_handle_at", "lookup_dcookie",
)
TIOCSTI: Final = 0x5412
TIOCLINUX: Final = 0x541C
# Namespace-creating clone flags: each is denied on its own (MASKED_EQ bit == bit).
AF_NETLINK: Final = 16
NETLINK_ROUTE: Final = 0
NET_FAMILIES: Final = (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6, AF_NETLINK)
# Families are enumerated up to here (AF_MAX is 46 in Linux 6.x); any larger
# number is refused by one range rule, so a future family is refused too.
FAMILY_SCAN: Final = 64
CLONE_NS_FLAGS: Final = (
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)
# No tool may make a setuid or setgid file (a host user running it would gain
# the call's uid or the workspace's group): every call that sets a mode fails
# with EPERM when the mode has S_ISUID or S_ISGID. syscall -> index of its mode.
S_ISUID: Final = 0o4000
S_ISGID: Final = 0o2000
MODE_ARG: Final = {"chmod": 1, "fchmod": 1, "fchmodat": 2, "fchmodat2": 2, "creat": 1,
                   "mknod": 1, "mknodat": 2}
# open/openat use their mode only when creating: (flags index, mode index).
CREATE_MODE_ARG: Final = {"open": (1, 2), "openat": (2, 3)}
O_CREAT: Final = 0o100
O_TMPFILE_BIT: Final = 0o20000000  # __O_TMPFILE


def _build(*, unix_sockets_only: bool) -> tuple[bytes, list[str]]:
    """Compile one filter to BPF; sockets: AF_UNIX only, or ``NET_FAMILIES``.
    Returns (bpf bytes, syscalls this libseccomp lacks)."""
    return _compile(NET_FAMILIES[:1] if unix_sockets_only else NET_FAMILIES)


def _compile(families: tuple[int, ...]) -> tuple[bytes, list[str]]:
    flt, missing = make_filter(families)
    fd = os.memfd_create("corral-seccomp-tmp", os.MFD_CLOEXEC)
    try:
        with os.fdopen(os.dup(fd), "wb") as fobj:
            flt.export_bpf(fobj)
        os.lseek(fd, 0, os.SEEK_SET)
        size = os.fstat(fd).st_size
        data = os.read(fd, size)
    finally:
        os.close(fd)
    if not data or len(data) % 8:
        raise SandboxSetupError(f"libseccomp exported a malformed filter ({len(data)} bytes)")
    return data, missing


def make_filter(families: tuple[int, ...]) -> tuple[Any, list[str]]:
    """The libseccomp filter object (tests export it as pseudo code) and the
    deny-list names this libseccomp does not know."""
    try:
        import pyseccomp as sc
    except (ImportError, RuntimeError) as exc:
        raise SandboxSetupError(
            f"libseccomp is not usable: {exc}",
            hint="install it: apt-get install libseccomp2, pip install pyseccomp",
        ) from exc
    flt = sc.SyscallFilter(sc.ALLOW)
    missing: list[str] = []
    eperm = sc.ERRNO(errno.EPERM)
    for name in DENIED_SYSCALLS:
        try:
            flt.add_rule(eperm, name)
        except (OSError, ValueError, RuntimeError):
            missing.append(name)
    for request in (TIOCSTI, TIOCLINUX):
        flt.add_rule(eperm, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
    for bit in CLONE_NS_FLAGS:
        flt.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, bit, bit))
    flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for bit in (S_ISUID, S_ISGID):
        for name, index in MODE_ARG.items():
            try:
                flt.add_rule(eperm, name, sc.Arg(index, sc.MASKED_EQ, bit, bit))
            except (OSError, ValueError, RuntimeError):
                missing.append(name)
        for name, (flags, mode) in CREATE_MODE_ARG.items():
            for create in (O_CREAT, O_TMPFILE_BIT):
                flt.add_rule(eperm, name, sc.Arg(flags, sc.MASKED_EQ, create, create),
                             sc.Arg(mode, sc.MASKED_EQ, bit, bit))
    # openat2 carries its mode in a struct seccomp cannot read; ENOSYS makes
    # callers fall back to openat, whose mode is checked above.
    flt.add_rule(sc.ERRNO(errno.ENOSYS), "openat2")
    no_family = sc.ERRNO(errno.EAFNOSUPPORT)
    for family in range(FAMILY_SCAN):
        if family not in families:
            flt.add_rule(no_family, "socket", sc.Arg(0, sc.EQ, family))
    flt.add_rule(no_family, "socket", sc.Arg(0, sc.GE, FAMILY_SCAN))
    if AF_NETLINK in families:
        flt.add_rule(no_family, "socket", sc.Arg(0, sc.EQ, AF_NETLINK),
                     sc.Arg(2, sc.NE, NETLINK_ROUTE))
    return flt, missing


def _sealed_memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    import fcntl

    fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    return fd


@dataclass
class SeccompFilters:
    """Compiled filters held as sealed memfds for the life of the worker."""

    memfds: dict[str, int] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)

    @classmethod
    def compile(cls) -> SeccompFilters:
        out = cls()
        for name, unix_only in (("bwrap", False), ("t1", True), ("t1_net", False)):
            data, missing = _build(unix_sockets_only=unix_only)
            out.memfds[name] = _sealed_memfd(f"corral-seccomp-{name}", data)
            out.sizes[name] = len(data)
            out.missing = missing
        if out.missing:
            log.warning("libseccomp does not know %s; those calls are not filtered",
                        ", ".join(out.missing))
        return out

    def open_fd(self, name: str) -> int:
        """A fresh, inheritable read-only fd at offset 0 (the caller closes it)."""
        fd = os.open(f"/proc/self/fd/{self.memfds[name]}", os.O_RDONLY)
        os.set_inheritable(fd, True)
        return fd

    def close(self) -> None:
        for fd in self.memfds.values():
            os.close(fd)
        self.memfds.clear()
