"""Try every entry of the seccomp deny-list once, harmlessly (x86-64).

Run inside a sandbox as ``python3 deny_probe.py`` (standard library only).
Prints one JSON object: entry -> errno (0: the call worked). Arguments are
chosen so that, where the kernel allows it, an *unfiltered* call fails with
something other than EPERM (a bad fd, a bad flag, a NULL pointer) or is a
no-op, so EPERM means the filter refused it. Entries gated by a capability
check that comes first give EPERM either way; the test checks those in the
compiled filter instead. Nothing here can change the system if allowed: no
call creates a namespace, a mount, a key or a process.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
CLONE_SIGHAND = 0x800  # without CLONE_VM: EINVAL before any child is made
NS_FLAGS = {"NEWNS": 0x00020000, "NEWCGROUP": 0x02000000, "NEWUTS": 0x04000000,
            "NEWIPC": 0x08000000, "NEWUSER": 0x10000000, "NEWPID": 0x20000000,
            "NEWNET": 0x40000000}
BAD = 0xFFFFFFFF
me = os.getpid()
CALLS: dict[str, tuple[int, ...]] = {
    "ptrace": (101, 3, me, 0, 0),  # PTRACE_PEEKUSER on self, not traced: ESRCH
    "process_vm_readv": (310, me, 0, 0, 0, 0, 0),  # zero iovecs of self: 0
    "process_vm_writev": (311, me, 0, 0, 0, 0, 0),
    "io_uring_setup": (425, 0, 0),
    "io_uring_enter": (426, -1, 0, 0, 0, 0, 0),
    "io_uring_register": (427, -1, 0, 0, 0),
    "bpf": (321, 999, 0, 0),
    "perf_event_open": (298, 0, 0, -1, -1, 0),
    "userfaultfd": (323, 1 | 0x40000000),  # USER_MODE_ONLY + a bad flag: EINVAL
    "keyctl": (250, 0, -3, 0),  # GET_KEYRING_ID of the session keyring, no create
    "add_key": (248, 0, 0, 0, 0, 0),
    "request_key": (249, 0, 0, 0, 0),
    "unshare": (272, 0),  # a no-op
    "setns": (308, -1, 0),
    "mount": (165, 0, 0, 0, 0, 0),
    "umount2": (166, 0, BAD),
    "pivot_root": (155, 0, 0),
    "open_tree": (428, -1, 0, BAD),
    "move_mount": (429, -1, 0, -1, 0, BAD),
    "fsopen": (430, 0, BAD),
    "fsconfig": (431, -1, 0, 0, 0, 0),
    "fsmount": (432, -1, BAD, 0),
    "fspick": (433, -1, 0, BAD),
    "mount_setattr": (442, -1, 0, BAD, 0, 0),
    "kexec_load": (246, 0, 0, 0, BAD),
    "kexec_file_load": (320, -1, -1, 0, 0, BAD),
    "init_module": (175, 0, 0, 0),
    "finit_module": (313, -1, 0, BAD),
    "delete_module": (176, 0, 0),
    "acct": (163, 0),
    "swapon": (167, 0, 0),
    "swapoff": (168, 0),
    "reboot": (169, 0, 0, 0, 0),
    "syslog": (103, 10, 0, 0),  # SYSLOG_ACTION_SIZE_BUFFER
    "quotactl": (179, 0, 0, 0, 0),
    "name_to_handle_at": (303, -1, 0, 0, 0, BAD),
    "open_by_handle_at": (304, -1, 0, 0),
    "lookup_dcookie": (212, 0, 0, 0),
    "clone3": (435, 0, 0),
}
for name, flag in NS_FLAGS.items():
    CALLS[f"clone({name})"] = (56, flag | CLONE_SIGHAND, 0, 0, 0, 0)


def syscall(nr: int, *args: int) -> int:
    ctypes.set_errno(0)
    if libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args]) >= 0:
        return 0
    return ctypes.get_errno()


def ioctl(request: int) -> int:
    fd = os.open("/dev/null", os.O_RDONLY)
    try:
        c = ctypes.c_char(b"x")
        ctypes.set_errno(0)
        if libc.ioctl(fd, ctypes.c_ulong(request), ctypes.byref(c)) >= 0:
            return 0
        return ctypes.get_errno()
    finally:
        os.close(fd)


def sock(family: int, kind: int = socket.SOCK_DGRAM, proto: int = 0) -> int:
    try:
        socket.socket(family, kind, proto).close()
    except OSError as exc:
        return exc.errno or -1
    return 0


def main() -> int:
    out = {name: syscall(*args) for name, args in CALLS.items()}
    out["ioctl(TIOCSTI)"] = ioctl(0x5412)
    out["ioctl(TIOCLINUX)"] = ioctl(0x541C)
    for family in [*range(64), 64, 200]:
        out[f"socket({family})"] = min(sock(family, socket.SOCK_DGRAM),
                                       sock(family, socket.SOCK_STREAM),
                                       sock(family, socket.SOCK_SEQPACKET),
                                       sock(family, socket.SOCK_RAW))
    for proto in (0, 4, 9, 15, 12):  # ROUTE, SOCK_DIAG, AUDIT, KOBJECT_UEVENT, NETFILTER
        out[f"netlink({proto})"] = sock(16, socket.SOCK_RAW, proto)
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
