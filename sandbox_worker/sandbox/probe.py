"""The in-sandbox probe: what the kernel shows a process at the end of a chain.

Run as ``python -I -S -c <this file's source> WRITE_DIR [--hold MARK]`` *as the
command* of a real argv chain (``Profile.build``), so it sees exactly what a
tool would. With ``--hold`` it stays alive after its report until stdin
closes, so the worker can read its namespaces from the host side too.
Standard library only (it starts without site-packages). Prints one JSON
object on stdout:

- ``status``: the Seccomp, Seccomp_filters, NoNewPrivs, Uid, Gid, Groups and
  Cap* lines of ``/proc/self/status`` (``null`` when /proc is not mounted);
- ``prctl``: ``PR_GET_SECCOMP`` and ``PR_GET_NO_NEW_PRIVS`` (work without /proc);
- ``ids``: ``getresuid``, ``getresgid``, ``getgroups``;
- ``ns``: ``readlink /proc/self/ns/*`` (the worker compares them with its own);
- ``interfaces``: the network interfaces seen (``null`` if netlink is refused);
- ``rlimits``: ``getrlimit`` of CPU, AS, NPROC, FSIZE, NOFILE, CORE;
- ``errno``: 0 when the operation worked, else its errno: ``unshare(0)`` (a
  no-op the deny-list refuses), ``socket(AF_VSOCK)``, ``socket(AF_INET)``,
  creating a file in WRITE_DIR (a world-writable host directory outside
  the workspace), in the working directory (the workspace: ``workspace_write``)
  and in its ``.git`` directory (``git_write``; -1 when there is none); each
  file is removed again if it was created.

Invariants: it changes nothing (the files it may create are removed, though
the directories' mtimes move), and
never raises: each fact it cannot read is reported as missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import socket
import sys

PR_GET_SECCOMP = 21
PR_GET_NO_NEW_PRIVS = 39
AF_VSOCK = 40
SYS_UNSHARE = {"x86_64": 272, "aarch64": 97}
STATUS_KEYS = ("Seccomp", "Seccomp_filters", "NoNewPrivs", "Uid", "Gid", "Groups", "CapEff",
               "CapPrm", "CapBnd", "CapAmb")
NAMESPACES = ("user", "pid", "net", "mnt", "ipc", "uts", "cgroup")
RLIMITS = {"cpu": "RLIMIT_CPU", "as": "RLIMIT_AS", "nproc": "RLIMIT_NPROC",
           "fsize": "RLIMIT_FSIZE", "nofile": "RLIMIT_NOFILE", "core": "RLIMIT_CORE"}

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def status() -> dict[str, list[str]] | None:
    try:
        with open("/proc/self/status") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    out = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in STATUS_KEYS:
            out[key] = value.split()
    return out


def namespaces() -> dict[str, str]:
    out = {}
    for name in NAMESPACES:
        with contextlib.suppress(OSError):
            out[name] = os.readlink(f"/proc/self/ns/{name}")
    return out


def interfaces() -> list[str] | None:
    try:
        return sorted(name for _, name in socket.if_nameindex())
    except OSError:
        return None


def unshare_noop() -> int:
    nr = SYS_UNSHARE.get(os.uname().machine)
    if nr is None:
        return -1
    ctypes.set_errno(0)
    if libc.syscall(ctypes.c_long(nr), ctypes.c_long(0)) == 0:
        return 0
    return ctypes.get_errno()


def socket_errno(family: int, kind: int) -> int:
    try:
        socket.socket(family, kind).close()
    except OSError as exc:
        return exc.errno or -1
    return 0


def write_errno(directory: str) -> int:
    path = os.path.join(directory, f".corral-probe-{os.getpid()}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError as exc:
        return exc.errno or -1
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(path)
    return 0


def main(argv: list[str]) -> int:
    out = {
        "status": status(),
        "prctl": {"seccomp": libc.prctl(PR_GET_SECCOMP, 0, 0, 0, 0),
                  "no_new_privs": libc.prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0)},
        "ids": {"uid": list(os.getresuid()), "gid": list(os.getresgid()),
                "groups": sorted(os.getgroups())},
        "ns": namespaces(),
        "interfaces": interfaces(),
        "rlimits": {k: list(resource.getrlimit(getattr(resource, v)))
                    for k, v in RLIMITS.items()},
        "errno": {"unshare": unshare_noop(),
                  "socket_vsock": socket_errno(AF_VSOCK, socket.SOCK_STREAM),
                  "socket_inet": socket_errno(socket.AF_INET, socket.SOCK_DGRAM),
                  "host_write": write_errno(argv[0]) if argv else -1,
                  # The chain starts in the workspace: what its bind (or
                  # Landlock) lets this uid do there and in its .git.
                  "workspace_write": write_errno("."),
                  "git_write": write_errno(".git") if os.path.isdir(".git") else -1},
    }
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    if "--hold" in argv:
        # The worker reads this process's /proc/<pid>/ns/* from the host while
        # it is alive, then closes stdin.
        sys.stdin.buffer.read()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
