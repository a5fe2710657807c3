"""The T1/T0 launcher: a tiny exec'd init that confines, then runs the command.

Run as ``python -I -S launch.py [options] -- ARGV...`` at the end of the
argv chain (after ``setpriv`` dropped the uid and ``prlimit`` set rlimits),
never in the worker's process (no ``preexec_fn``). Standard library only, so
it starts without site-packages.

What it does, in order:
1. ``PR_SET_PDEATHSIG`` = SIGHUP: when the worker dies, this init kills the
   command's whole tree and exits; ``PR_SET_CHILD_SUBREAPER``: orphans of the
   command re-parent here, so a double-forked daemon stays in reach.
2. Landlock (``--landlock``): read/execute everywhere, write only beneath the
   workspace (not with ``--read-only``) and the private tmp dir (and a few
   /dev nodes); TCP bind/connect
   denied unless ``--net`` (ABI >= 4); signals and abstract unix sockets
   scoped to the sandbox (ABI >= 6).
   (``--scope-only -- ARGV``: only the abstract-socket scope, then exec
   ARGV: the link before bwrap on a T2 network grant.)
3. Forks the command in a new session; the child loads the seccomp filter
   read from ``--seccomp-fd`` (deny-list, AF_UNIX-only sockets) and execs.
4. Acts as init: reaps everything; forwards SIGTERM/SIGINT to every child;
   when the command exits, SIGKILLs whatever it left behind and exits with
   its status (``128+N`` when killed by signal N, as bwrap does).

Tier detection *tries* these layers by running ``probe.py`` as the command
(``verify.py``): what the kernel shows the command is what counts.

Invariants: nothing of the command outlives this process; this process
outlives nothing of the command except by SIGKILL of itself, in which case
the worker's kill_tree finds and kills every process of the call's uid.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
PR_SET_CHILD_SUBREAPER = 36
SYS_LANDLOCK_CREATE_RULESET = 444  # same number on x86-64 and aarch64
SYS_LANDLOCK_ADD_RULE = 445
SYS_LANDLOCK_RESTRICT_SELF = 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1

FS_EXECUTE = 1 << 0
FS_WRITE_FILE = 1 << 1
FS_READ_FILE = 1 << 2
FS_READ_DIR = 1 << 3
FS_TRUNCATE = 1 << 14
FS_IOCTL_DEV = 1 << 15
# Rights by ABI version: 1 has bits 0-12, 2 adds REFER, 3 TRUNCATE, 5 IOCTL_DEV.
FS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1,
             5: (1 << 16) - 1}
FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
NET_BIND_TCP = 1 << 0
NET_CONNECT_TCP = 1 << 1
SCOPE_ABSTRACT_UNIX = 1 << 0
SCOPE_SIGNAL = 1 << 1
WRITABLE_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/tty")

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


class RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64),
                ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _fail(what: str) -> None:
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


def _prctl(option: int, arg: int, arg3: int = 0) -> None:
    if libc.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(arg3), 0, 0) != 0:
        _fail(f"prctl({option})")


def landlock_abi() -> int:
    abi = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                       ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    return int(abi) if abi > 0 else 0


def apply_landlock(writable: list[str], *, net: bool) -> int:
    abi = landlock_abi()
    if abi <= 0:
        raise OSError("landlock is not available")
    fs_all = FS_BY_ABI.get(abi, FS_BY_ABI[5])
    attr = RulesetAttr(handled_access_fs=fs_all, handled_access_net=0, scoped=0)
    size = 8
    if abi >= 4:
        size = 16
        if not net:
            attr.handled_access_net = NET_BIND_TCP | NET_CONNECT_TCP
    if abi >= 6:
        size = 24
        attr.scoped = SCOPE_ABSTRACT_UNIX | SCOPE_SIGNAL
    rfd = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size),
                       ctypes.c_uint32(0))
    if rfd < 0:
        _fail("landlock_create_ruleset")

    def allow(path: str, access: int) -> None:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return
        try:
            is_dir = os.path.isdir(f"/proc/self/fd/{fd}")
            rule = PathBeneathAttr(allowed_access=access & (fs_all if is_dir else FILE_RIGHTS)
                                   & fs_all, parent_fd=fd)
            if libc.syscall(SYS_LANDLOCK_ADD_RULE, ctypes.c_int(rfd),
                            ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH), ctypes.byref(rule),
                            ctypes.c_uint32(0)) != 0:
                _fail(f"landlock_add_rule({path})")
        finally:
            os.close(fd)

    allow("/", FS_EXECUTE | FS_READ_FILE | FS_READ_DIR)
    for path in writable:
        allow(path, fs_all)
    for dev in WRITABLE_DEVICES:
        allow(dev, FS_READ_FILE | FS_WRITE_FILE | FS_TRUNCATE | FS_IOCTL_DEV)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    if libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(rfd), ctypes.c_uint32(0)) != 0:
        _fail("landlock_restrict_self")
    os.close(rfd)
    return abi


def scope_and_exec(command: list[str]) -> None:
    """``--scope-only``: confine this process's abstract unix sockets to its
    own Landlock domain (no file or network rule, ABI >= 6), then exec
    ``command``. Put before bwrap on a T2 network grant: the call then shares
    the host's network namespace, whose abstract sockets (an X server's, a
    desktop bus's) it could otherwise connect to."""
    attr = RulesetAttr(handled_access_fs=0, handled_access_net=0,
                       scoped=SCOPE_ABSTRACT_UNIX)
    rfd = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(24),
                       ctypes.c_uint32(0))
    if rfd < 0:
        _fail("landlock_create_ruleset (scope)")
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    if libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(rfd), ctypes.c_uint32(0)) != 0:
        _fail("landlock_restrict_self (scope)")
    os.close(rfd)
    os.execvp(command[0], command)


def load_seccomp(fd: int) -> None:
    chunks = []
    while True:
        data = os.read(fd, 65536)
        if not data:
            break
        chunks.append(data)
    os.close(fd)
    bpf = b"".join(chunks)
    if not bpf or len(bpf) % 8:
        raise OSError("malformed seccomp filter")
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = SockFprog(len=len(bpf) // 8, filter=ctypes.cast(buf, ctypes.c_void_p))
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        _fail("seccomp filter")


def children() -> list[int]:
    pids: list[int] = []
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as f:
                pids.extend(int(p) for p in f.read().split())
    except OSError:
        pass
    return pids


def kill_children(sig: int) -> None:
    for pid in children():
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


def status_code(status: int) -> int:
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.waitstatus_to_exitcode(status)


def main(argv: list[str]) -> int:
    if argv[:2] == ["--scope-only", "--"] and len(argv) > 2:
        scope_and_exec(argv[2:])  # returns only by raising
    opts: dict[str, str] = {}
    flags: set[str] = set()
    i = 0
    while i < len(argv) and argv[i] != "--":
        arg = argv[i]
        if arg in ("--landlock", "--net", "--read-only"):
            flags.add(arg)
            i += 1
        else:
            opts[arg] = argv[i + 1]
            i += 2
    command = argv[i + 1:]
    parent = os.getppid()
    state = {"finishing": False}

    def parent_died(signum: int, _frame: object) -> None:
        # The worker is gone: end the whole call (the wait loop below keeps
        # killing orphans as they re-parent here, then exits).
        if os.getppid() != parent:
            state["finishing"] = True
            kill_children(signal.SIGKILL)

    # SIGHUP, not SIGKILL: this init must outlive its parent long enough to
    # kill the command's tree, which has no pid namespace to die with.
    signal.signal(signal.SIGHUP, parent_died)
    _prctl(PR_SET_PDEATHSIG, signal.SIGHUP)
    if os.getppid() != parent:
        return 125  # the worker-side parent is already gone
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    # --read-only: the workspace is where the command starts, but not writable.
    ws = None if "--read-only" in flags else opts.get("--workspace")
    writable = [p for p in (ws, opts.get("--tmpdir")) if p]
    if "--landlock" in flags:
        apply_landlock(writable, net="--net" in flags)
    seccomp_fd = int(opts["--seccomp-fd"]) if "--seccomp-fd" in opts else -1
    if not command:
        sys.stderr.write("launch: no command given\n")
        return 125
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            signal.signal(signal.SIGHUP, signal.SIG_DFL)
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the command dies with this init
            if seccomp_fd >= 0:
                load_seccomp(seccomp_fd)
            workdir = opts.get("--chdir") or opts.get("--workspace")
            if workdir:
                os.chdir(workdir)
            os.execvp(command[0], command)
        except OSError as exc:
            sys.stderr.write(f"launch: cannot run {command[0]}: {exc.strerror}\n")
            os._exit(127)
    if seccomp_fd >= 0:
        os.close(seccomp_fd)

    def forward(signum: int, _frame: object) -> None:
        kill_children(signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = 0
    if state["finishing"]:
        kill_children(signal.SIGKILL)
    while True:
        try:
            got, status = os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if got == pid:
            code = status_code(status)
            state["finishing"] = True
        if state["finishing"]:
            # The command is done: nothing it started may outlive the call.
            # Orphans re-parent here as their parents die, so repeat per reap.
            kill_children(signal.SIGKILL)
    return code


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except OSError as exc:
        sys.stderr.write(f"launch: {exc}\n")
        sys.exit(125)
