"""Tiers, the per-call argv chain, and the isolation record.

Every shell call is started as one argv chain with no ``preexec_fn``::

    [sh -c <join worker cgroup>]            when the worker cgroup applied
    setpriv --reuid U --regid G --clear-groups --inh-caps=-all      U: the call's own uid
            --bounding-set=-all --no-new-privs --
    prlimit --cpu --as --nproc --fsize --nofile --core=0 --
    T2/T2-: bwrap --unshare-all [--share-net] --unshare-user --disable-userns
                  --die-with-parent --new-session --cap-drop ALL --clearenv
                  --ro-bind /usr,/etc,/opt (+ merged-usr links) --proc /proc
                  --dev /dev --size N --tmpfs /tmp --size N --tmpfs /dev/shm
                  --bind WS WS --remount-ro / --chdir WS --seccomp FD -- COMMAND
    T1/T0:  python -I -S launch.py [--landlock] [--net] --workspace WS
                  --tmpdir TMP [--seccomp-fd FD] -- COMMAND

Invariants:
- The uid drop is always the first confining link: bwrap and the launcher
  never run as uid 0.
- U is the call's own uid from the worker's ``UidPool`` (``uid=``), G the
  shared sandbox group; U is never 0 (checked here) and never the file
  tools' uid.
- ``isolation`` describes exactly what ``build`` applies for the same inputs
  (tier, network grant, limits, cgroup), so every result's record is true.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from broker import plants  # chaos plant switches
from sandbox_worker.api import TIER_ORDER, IsolationRecord, Tier, ToolLimits
from sandbox_worker.sandbox.cgroup import WorkerCgroup
from sandbox_worker.sandbox.limits import prlimit_argv
from sandbox_worker.sandbox.seccomp import SeccompFilters
from sandbox_worker.sandbox.user import SandboxUser

# The launcher runs as ``python -I -S -c <source>``: the sandbox uid needs no
# access to the worker's installation, only to some interpreter.
# Calls run as different uids, so a repository one call created is "owned by
# someone else" for the next; git refuses that unless told otherwise.
GIT_SAFE_ENV: Final = {"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "safe.directory",
                       "GIT_CONFIG_VALUE_0": "*"}
LAUNCHER_SOURCE: Final = Path(__file__).with_name("launch.py").read_text()
SANDBOX_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SYSTEM_DIRS: Final = ("/usr", "/etc", "/opt")
MERGED_USR: Final = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
TIERS: Final[tuple[Tier, ...]] = ("T2", "T2-", "T1", "T0")


def _usable_by_others(path: str) -> bool:
    """Executable by "other", and every parent directory searchable by "other"."""
    real = os.path.realpath(path)
    try:
        if not os.stat(real).st_mode & 0o001:
            return False
        parent = os.path.dirname(real)
        while parent != "/":
            if not os.stat(parent).st_mode & 0o001:
                return False
            parent = os.path.dirname(parent)
    except OSError:
        return False
    return True


def launcher_python() -> str:
    """An interpreter the sandbox uid can run (the worker's may sit under /root)."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if candidate and _usable_by_others(candidate):
            return os.path.realpath(candidate)
    return "/usr/bin/python3"


def tier_at_least(tier: Tier, minimum: Tier) -> bool:
    return TIER_ORDER[tier] >= TIER_ORDER[minimum]


def system_binds() -> list[str]:
    args: list[str] = []
    for path in SYSTEM_DIRS:
        if os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in MERGED_USR:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


@dataclass
class Chain:
    argv: list[str]
    env: dict[str, str]
    pass_fds: list[int] = field(default_factory=list)


@dataclass
class Profile:
    """The applied sandbox of one worker: its tier and the layers it holds."""

    tier: Tier
    user: SandboxUser
    filters: SeccompFilters | None
    cgroup: WorkerCgroup | None
    tmp_root: str = "/var/tmp"
    python: str = field(default_factory=lambda: launcher_python())
    unsandboxed_opt_in: bool = False
    extra_degraded: list[str] = field(default_factory=list)

    def build(self, command: list[str], workspace: str, limits: ToolLimits, *,
              network: bool, uid: int, tmpdir: str | None = None, call_id: str = "",
              workdir: str = ".") -> Chain:
        """The argv chain running ``command`` in ``workspace`` as ``uid`` (the
        call's own, from the uid pool) and the sandbox group; fds in
        ``pass_fds`` belong to the caller, who closes them once the chain has
        started."""
        if uid <= 0:
            raise ValueError(f"refusing to run a tool as uid {uid}")
        head = self.cgroup.join_prefix() if self.cgroup is not None else []
        head += ["setpriv", f"--reuid={uid}", f"--regid={self.user.gid}",
                 "--clear-groups", "--inh-caps=-all", "--bounding-set=-all",
                 "--no-new-privs", "--"]
        head += prlimit_argv(limits)
        env_inside = {"PATH": SANDBOX_PATH, "LANG": "C.UTF-8", "TERM": "dumb",
                      "CORRAL_SANDBOX": self.tier, "CORRAL_CALL_ID": call_id, **GIT_SAFE_ENV}
        pass_fds: list[int] = []
        if self.tier in ("T2", "T2-"):
            argv = [*head, "bwrap", "--unshare-all"]
            if network:
                argv.append("--share-net")
            argv += ["--unshare-user", "--disable-userns", "--die-with-parent",
                     "--new-session", "--cap-drop", "ALL", "--clearenv"]
            if plants.on("no_tree_kill"):  # chaos plant: the sandbox outlives its parent
                argv.remove("--die-with-parent")
            for key, value in {**env_inside, "HOME": "/tmp", "TMPDIR": "/tmp"}.items():
                argv += ["--setenv", key, value]
            argv += system_binds()
            if self.tier == "T2":
                argv += ["--proc", "/proc"]
            cwd = workspace if workdir == "." else f"{workspace}/{workdir}"
            size = str(limits["tmpfs_bytes"])
            # /tmp and /dev/shm are private size-limited tmpfs; bwrap's own root
            # tmpfs is remounted read-only so nothing else is writable.
            argv += ["--dev", "/dev", "--size", size, "--tmpfs", "/tmp",
                     "--size", size, "--tmpfs", "/dev/shm",
                     "--bind", workspace, workspace, "--remount-ro", "/dev",
                     "--remount-ro", "/", "--chdir", cwd]
            if self.filters is not None:
                fd = self.filters.open_fd("bwrap")
                pass_fds.append(fd)
                argv += ["--seccomp", str(fd)]
            argv += ["--", *command]
            # The head's own environment: nothing of the worker's (bwrap clears it anyway).
            return Chain(argv, {"PATH": SANDBOX_PATH, "LANG": "C.UTF-8"}, pass_fds)
        tmp = tmpdir or "/tmp"
        argv = [*head, self.python, "-I", "-S", "-c", LAUNCHER_SOURCE,
                "--workspace", workspace, "--tmpdir", tmp]
        if workdir != ".":
            argv += ["--chdir", f"{workspace}/{workdir}"]
        if self.tier == "T1":
            argv.append("--landlock")
            if network:
                argv.append("--net")
            if self.filters is not None:
                fd = self.filters.open_fd("t1_net" if network else "t1")
                pass_fds.append(fd)
                argv += ["--seccomp-fd", str(fd)]
        argv += ["--", *command]
        env = {**env_inside, "HOME": tmp, "TMPDIR": tmp}
        return Chain(argv, env, pass_fds)

    def degraded(self, *, shell: bool = True) -> list[str]:
        out: list[str] = []
        if self.tier == "T2-":
            out.append("no /proc: bwrap cannot mount procfs here")
        if self.tier == "T1":
            out += ["no pid namespace: the host's process list is visible",
                    "no mount namespace: the host filesystem is readable where permissions "
                    "and Landlock allow",
                    "no network namespace: network restricted by seccomp (AF_UNIX only) "
                    "and Landlock TCP rules"]
        if self.tier == "T0":
            out.append("unsandboxed: only the uid drop and rlimits apply (operator opt-in)")
        if shell and self.cgroup is not None and not self.cgroup.applied:
            out.append(self.cgroup.reason or "worker cgroup not applied")
        return out + self.extra_degraded

    def isolation(self, limits: ToolLimits, *, network: bool, uid: int) -> IsolationRecord:
        """The record of a shell call built by ``build`` with the same inputs."""
        if self.tier in ("T2", "T2-"):
            filesystem = "ro-system+rw-workspace+tmpfs"
            net = "granted" if network else "none"
        elif self.tier == "T1":
            filesystem = "landlock:ro-host+rw-workspace"
            net = "granted" if network else "none"
        else:
            filesystem = "host"
            net = "host"
        return IsolationRecord(
            tier=self.tier, filesystem=filesystem, network=net,  # type: ignore[typeddict-item]
            pid_namespace=self.tier in ("T2", "T2-"),
            seccomp=self.filters is not None and self.tier != "T0",
            uid=uid, limits=ToolLimits(**limits),
            degraded=self.degraded(), unsandboxed_opt_in=self.unsandboxed_opt_in,
        )

    def file_isolation(self, limits: ToolLimits) -> IsolationRecord:
        """The record of a file tool: worker-side, confined by openat2, with the
        file tools' fsuid (the sandbox user's uid, outside the per-call range)."""
        return IsolationRecord(
            tier=self.tier, filesystem="workspace-openat2", network="none",
            pid_namespace=False, seccomp=False, uid=self.user.uid,
            limits=ToolLimits(**limits), degraded=self.degraded(shell=False),
            unsandboxed_opt_in=self.unsandboxed_opt_in,
        )
