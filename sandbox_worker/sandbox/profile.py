"""Tiers, the per-call argv chain, and the isolation record.

Every shell call is started as one argv chain with no ``preexec_fn``::

    [sh -c <join worker cgroup>]            when the worker cgroup applied
    setpriv --reuid U --regid G --clear-groups --inh-caps=-all      U: the call's own uid
            --bounding-set=-all --no-new-privs --
    prlimit --cpu --as --nproc --fsize --nofile --core=0 --
    T2/T2-: [python -I -S launch.py --scope-only --]   on a network grant
            bwrap --unshare-all [--share-net] --unshare-user --disable-userns
                  --die-with-parent --new-session --cap-drop ALL --clearenv
                  --ro-bind /usr,/etc,/opt (+ merged-usr links) --proc /proc
                  --dev /dev --size N --tmpfs /tmp --size N --tmpfs /dev/shm
                  --bind-fd WSFD /workspace (--ro-bind-fd when read-only)
                  [--ro-bind-fd GITFD /workspace/REL ...] --remount-ro /
                  --chdir /workspace --seccomp FD -- COMMAND
    T1/T0:  python -I -S launch.py [--landlock] [--net] --workspace WS
                  --tmpdir TMP [--seccomp-fd FD] -- COMMAND

Invariants:
- The uid drop is always the first confining link: bwrap and the launcher
  never run as uid 0.
- U is the call's own uid from the worker's ``UidPool`` (``uid=``), G the
  workspace's own group (``gid=``, ``wsgroups.py``); U is never 0 (checked
  here) and never the file tools' uid.
- At T2/T2- the workspace is bound from the worker's pinned fd (bwrap checks
  that what it mounted is that fd's directory) at the neutral path
  ``/workspace``; ``.git`` entries handed in ``ro_fds`` are bound read-only
  over it, so the sandbox cannot write them.
- ``isolation`` never states what was configured: it is derived from what
  the kernel showed ``probe.py`` run at the end of a chain of the same shape
  (``verify.py``); a shape never probed is recorded as not verified.
- Every chain carries its ``shape`` (argv before the command, per-call values
  masked); ``verify_chain`` probes one and keeps the result in ``verified``.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final

from broker import plants  # chaos plant switches
from sandbox_worker.api import TIER_ORDER, IsolationRecord, SandboxMode, Tier, ToolLimits
from sandbox_worker.sandbox.cgroup import WorkerCgroup
from sandbox_worker.sandbox.images import ImageRoot
from sandbox_worker.sandbox.launch import landlock_abi
from sandbox_worker.sandbox.limits import DEFAULT_LIMITS, prlimit_argv
from sandbox_worker.sandbox.overlay import Layer, mount_layer
from sandbox_worker.sandbox.seccomp import SeccompFilters
from sandbox_worker.sandbox.user import SandboxUser
from sandbox_worker.sandbox.verify import (
    PROBE_SOURCE,
    RLIMIT_OF,
    Expect,
    KernelView,
    chain_shape,
    expected_rlimits,
    host_namespaces,
    kernel_facts,
    run_probe,
    shortfalls,
)

# The launcher runs as ``python -I -S -c <source>``: the sandbox uid needs no
# access to the worker's installation, only to some interpreter.
# Calls run as different uids, so a repository one call created is "owned by
# someone else" for the next; git refuses that unless told otherwise.
GIT_SAFE_ENV: Final = {"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "safe.directory",
                       "GIT_CONFIG_VALUE_0": "*"}
LAUNCHER_SOURCE: Final = Path(__file__).with_name("launch.py").read_text()
SANDBOX_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SYSTEM_DIRS: Final = ("/usr", "/etc", "/opt")
SANDBOX_WORKSPACE: Final = "/workspace"  # where T2 binds the workspace (hides its host path)
MERGED_USR: Final = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
TIERS: Final[tuple[Tier, ...]] = ("T2", "T2-", "T1", "T0")
MAX_SHAPES: Final = 64  # probed chain shapes kept per profile (oldest dropped)
# The probe of an image chain runs the host's interpreter from here (an image
# need not hold Python): the host's /usr bound read-only, only for the probe.
PROBE_USR: Final = "/.corral-probe/usr"
LOADERS: Final = ("/lib64/ld-linux-x86-64.so.2", "/lib/ld-linux-aarch64.so.1")


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


def cg_mark(directory: str) -> str:
    """How /proc/<pid>/cgroup names a member of ``directory``: ``/corral/worker-N``."""
    return "/" + "/".join(directory.rstrip("/").split("/")[-2:])


def probe_in_image(python: str, marker: str) -> list[str]:
    """``probe.py`` run by the host's interpreter through the host's dynamic
    loader, both seen under ``PROBE_USR`` (so it needs nothing of the image).
    The write it tries is in the image's ``/``, which the call cannot write."""
    real = os.path.realpath(python)
    loader = next((os.path.realpath(p) for p in LOADERS if os.path.exists(p)), "")
    if not real.startswith("/usr/") or not loader.startswith("/usr/"):
        return ["/nonexistent/corral-probe-needs-usr"]  # the probe fails: never verified
    libs = f"{PROBE_USR}{os.path.dirname(loader)[4:]}:{PROBE_USR}/lib"
    return [PROBE_USR + loader[4:], "--library-path", libs, PROBE_USR + real[4:],
            "-I", "-S", "-c", PROBE_SOURCE, "/", "--hold", marker]


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


def bwrap_start(head: list[str], network: bool, scope: tuple[str, ...] = ()) -> list[str]:
    """``head``, ``scope`` (the link confining abstract unix sockets on a
    network grant, ``Profile.scope_link``), then bwrap with the namespaces
    every T2/T2- chain (host or image) separates: all of them, the network
    shared only with ``network``, no user namespaces inside, no
    capabilities, an empty environment."""
    argv = [*head, *scope, "bwrap", "--unshare-all"]
    if network:
        argv.append("--share-net")
    return [*argv, "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--cap-drop", "ALL", "--clearenv"]


def call_mounts(size: str, workspace: str, inside: str, *, workspace_fd: int | None,
                read_only: bool, ro_fds: tuple[tuple[int, str], ...],
                pass_fds: list[int]) -> list[str]:
    """The mounts every T2/T2- chain (host or image) gives a call: a fresh
    ``/dev``, private size-limited ``/tmp`` and ``/dev/shm`` tmpfs, the
    workspace at ``inside`` (from the pinned fd when given; read-only with
    ``read_only``) and each ``ro_fds`` entry (a ``.git``) bound read-only over
    it; an entry whose path ends in ``/`` (a directory holding a nested
    ``.git``, listed before it) is bound over itself as the workspace is, so
    that it is a mount point no call can rename. The fds handed to bwrap are
    dups appended to ``pass_fds``."""
    argv = ["--dev", "/dev", "--size", size, "--tmpfs", "/tmp",
            "--size", size, "--tmpfs", "/dev/shm"]
    if workspace_fd is not None:
        wfd = os.dup(workspace_fd)
        pass_fds.append(wfd)
        argv += ["--ro-bind-fd" if read_only else "--bind-fd", str(wfd), inside]
    else:
        argv += ["--ro-bind" if read_only else "--bind", workspace, inside]
    for fd, rel in ro_fds:
        dup = os.dup(fd)
        pass_fds.append(dup)
        if rel.endswith("/"):  # a directory a nested .git is in: pinned against renames
            argv += ["--ro-bind-fd" if read_only else "--bind-fd", str(dup),
                     f"{inside}/{rel.rstrip('/')}"]
        else:
            argv += ["--ro-bind-fd", str(dup), f"{inside}/{rel}"]
    return argv


Shape = tuple[str, ...]


@dataclass
class Chain:
    argv: list[str]
    env: dict[str, str]
    pass_fds: list[int] = field(default_factory=list)
    shape: Shape = ()  # argv before the command, per-call values masked (verify.py)


@dataclass(frozen=True)
class Verified:
    """One probed chain shape: what it was built to apply, what the kernel
    showed (None if the probe did not run to the end), and the shortfalls
    (or why the probe failed); empty ``problems`` means the tier held."""

    expect: Expect
    view: KernelView | None
    problems: list[str]


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
    verified: dict[Shape, Verified] = field(default_factory=dict)
    host_ns: dict[str, str] = field(default_factory=host_namespaces)
    # Landlock can scope abstract unix sockets (ABI >= 6): granted T2 calls get
    # the scope link before bwrap (``scope_link``)
    abstract_scope: bool = field(default_factory=lambda: landlock_abi() >= 6)

    def build(self, command: list[str], workspace: str, limits: ToolLimits, *,
              network: bool, uid: int, tmpdir: str | None = None, call_id: str = "",
              workdir: str = ".", workspace_fd: int | None = None, gid: int | None = None,
              read_only: bool = False, ro_fds: tuple[tuple[int, str], ...] = (),
              image: ImageRoot | None = None, layer: Layer | None = None,
              probe: bool = False) -> Chain:
        """The argv chain running ``command`` in ``workspace`` as ``uid`` (the
        call's own, from the uid pool) and ``gid`` (the workspace's group;
        the sandbox user's when None). At T2 the workspace is bound from
        ``workspace_fd`` (the worker's pinned fd) when given, read-only with
        ``read_only``, and each ``(fd, relative path)`` of ``ro_fds`` is bound
        read-only at that path inside it. Fds in ``pass_fds`` are the chain's
        own duplicates: the caller closes them once the chain has started.
        With ``image`` and its mounted ``layer`` (T2/T2- only; ``image_layer``)
        the call runs over that image's root instead of the host's
        (``_image_chain``); ``probe`` adds what the probe needs there,
        outside the chain's shape."""
        if uid <= 0:
            raise ValueError(f"refusing to run a tool as uid {uid}")
        group = self.user.gid if gid is None else gid
        if group <= 0:
            raise ValueError(f"refusing to run a tool with gid {group}")
        head = self.cgroup.join_prefix() if self.cgroup is not None else []
        head += ["setpriv", f"--reuid={uid}", f"--regid={group}",
                 "--clear-groups", "--inh-caps=-all", "--bounding-set=-all",
                 "--no-new-privs", "--"]
        head += prlimit_argv(limits)
        env_inside = {"PATH": SANDBOX_PATH, "LANG": "C.UTF-8", "TERM": "dumb",
                      "CORRAL_SANDBOX": self.tier, "CORRAL_CALL_ID": call_id, **GIT_SAFE_ENV}
        pass_fds: list[int] = []
        if image is not None:
            if layer is None:
                raise ValueError("an image chain needs the call's mounted layer")
            return self._image_chain(head, command, workspace, limits, env_inside,
                                     network=network, uid=uid, group=group, call_id=call_id,
                                     workdir=workdir, workspace_fd=workspace_fd,
                                     read_only=read_only, ro_fds=ro_fds, image=image,
                                     layer=layer, probe=probe)
        if self.tier in ("T2", "T2-"):
            argv = bwrap_start(head, network, self.scope_link(network))
            if plants.on("no_tree_kill"):  # chaos plant: the sandbox outlives its parent
                argv.remove("--die-with-parent")
            for key, value in {**env_inside, "HOME": "/tmp", "TMPDIR": "/tmp"}.items():
                argv += ["--setenv", key, value]
            argv += system_binds()
            if self.tier == "T2":
                argv += ["--proc", "/proc"]
            inside = SANDBOX_WORKSPACE
            cwd = inside if workdir == "." else f"{inside}/{workdir}"
            size = str(limits["tmpfs_bytes"])
            argv += call_mounts(size, workspace, inside, workspace_fd=workspace_fd,
                                read_only=read_only, ro_fds=ro_fds, pass_fds=pass_fds)
            # bwrap's own root tmpfs is remounted read-only so nothing else is writable.
            argv += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", cwd]
            argv += self._bwrap_seccomp(pass_fds)
            argv += ["--", *command]
            # The head's own environment: nothing of the worker's (bwrap clears it anyway).
            shape = chain_shape(argv[:len(argv) - len(command)],
                                [str(uid), str(group), call_id, workspace, inside, cwd,
                                 size, *map(str, pass_fds)])
            return Chain(argv, {"PATH": SANDBOX_PATH, "LANG": "C.UTF-8"}, pass_fds, shape)
        tmp = tmpdir or "/tmp"
        # Read-only at T1: Landlock grants writes to the tmp dir alone, and the
        # command starts in the workspace, which it can then only read. The
        # flag (not only the values) tells the shapes apart, so each mode's
        # record comes from a probe of that mode.
        argv = [*head, self.python, "-I", "-S", "-c", LAUNCHER_SOURCE,
                "--workspace", workspace, "--tmpdir", tmp]
        if read_only:
            argv.append("--read-only")
        # Always given, so that a call with a workdir has the same shape as one without.
        cwd = workspace if workdir == "." else f"{workspace}/{workdir}"
        argv += ["--chdir", cwd]
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
        shape = chain_shape(argv[:len(argv) - len(command)],
                            [str(uid), str(group), call_id, workspace, tmp, cwd,
                             *map(str, pass_fds)])
        return Chain(argv, env, pass_fds, shape)

    def _image_chain(self, head: list[str], command: list[str], workspace: str,
                     limits: ToolLimits, env_inside: dict[str, str], *, network: bool,
                     uid: int, group: int, call_id: str, workdir: str,
                     workspace_fd: int | None, read_only: bool,
                     ro_fds: tuple[tuple[int, str], ...], image: ImageRoot,
                     layer: Layer, probe: bool) -> Chain:
        """The chain over an image root (docs/images.md): bwrap binds the
        call's layer (``overlay.py``: the verified image root read-only under a
        per-call tmpfs writable layer, mounted by the worker) as ``/`` (not
        remounted read-only: the layer is the call's), then ``/proc``,
        ``/dev``, a private ``/tmp`` and ``/dev/shm``, and the workspace at
        the image's WorkingDir; the uid drop, rlimits and the rest as for
        every call."""
        if self.tier not in ("T2", "T2-"):
            raise ValueError(f"image roots need tier T2 or T2-, not {self.tier}")
        size = str(limits["tmpfs_bytes"])
        inside = image.workdir
        cwd = inside if workdir == "." else f"{inside}/{workdir}"
        pass_fds: list[int] = []
        # The image's variables, then the chain's own (which an image cannot replace).
        env = {"PATH": SANDBOX_PATH, **image.env, "HOME": image.home or "/tmp",
               "TMPDIR": "/tmp", "LANG": image.env.get("LANG", "C.UTF-8"), "TERM": "dumb",
               **{k: v for k, v in env_inside.items() if k not in ("PATH", "LANG", "TERM")}}
        argv = bwrap_start(head, network, self.scope_link(network))
        for key, value in env.items():
            argv += ["--setenv", key, value]
        argv += ["--bind", layer.root, "/"]
        probe_at = len(argv)
        if probe:
            argv += ["--ro-bind", "/usr", PROBE_USR]
        if self.tier == "T2":
            argv += ["--proc", "/proc"]
        argv += call_mounts(size, workspace, inside, workspace_fd=workspace_fd,
                            read_only=read_only, ro_fds=ro_fds, pass_fds=pass_fds)
        argv += ["--remount-ro", "/dev", "--chdir", cwd]
        argv += self._bwrap_seccomp(pass_fds)
        argv += ["--", *command]
        # The shape: the probe's additions and the layer's path left out (a
        # probe of this shape stands for the calls without them); the image's
        # variables and WorkingDir kept (each image is probed once per worker).
        head_argv = argv[:len(argv) - len(command)]
        if probe:
            del head_argv[probe_at:probe_at + 3]
        shape = chain_shape(head_argv, [str(uid), str(group), call_id, workspace, cwd,
                                        size, layer.root, *map(str, pass_fds)])
        return Chain(argv, {"PATH": SANDBOX_PATH, "LANG": "C.UTF-8"}, pass_fds, shape)

    def scope_link(self, network: bool) -> tuple[str, ...]:
        """The chain link before bwrap on a network grant (T2/T2-): the
        launcher in ``--scope-only`` mode, which confines abstract unix
        sockets to the call (the shared network namespace holds the host's)
        and execs bwrap. Empty without a grant, or when Landlock cannot scope
        (ABI < 6: the host's abstract sockets are then reachable, as
        docs/sandbox.md says)."""
        if not network or not self.abstract_scope:
            return ()
        return (self.python, "-I", "-S", "-c", LAUNCHER_SOURCE, "--scope-only", "--")

    def _bwrap_seccomp(self, pass_fds: list[int]) -> list[str]:
        """bwrap's seccomp filter (an fd appended to ``pass_fds``), if there is one."""
        if self.filters is None:
            return []
        fd = self.filters.open_fd("bwrap")
        pass_fds.append(fd)
        return ["--seccomp", str(fd)]

    async def image_layer(self, image: ImageRoot, limits: ToolLimits, uid: int,
                          gid: int | None, *, probe: bool = False) -> Layer:
        """Mount one call's layer over ``image`` (``overlay.mount_layer``): the
        mount points the image lacks, the image user's home given to ``uid``."""
        group = self.user.gid if gid is None else gid
        dirs = [d for d in ("/proc", "/dev", "/tmp", image.workdir) if d not in image.has]
        return await asyncio.to_thread(mount_layer, image.fd, int(limits["tmpfs_bytes"]),
                                       [*dirs, PROBE_USR] if probe else dirs, image.home,
                                       uid, group)

    def probe_command(self, marker: str) -> list[str]:
        """``probe.py`` as a command; it tries to write into ``tmp_root`` (a
        world-writable host directory outside every workspace) and, once it
        has reported, waits on stdin so the worker can read its namespaces
        (found by ``marker``)."""
        return [self.python, "-I", "-S", "-c", PROBE_SOURCE, self.tmp_root, "--hold", marker]

    async def verify_chain(self, workspace: str, *, network: bool, uid: int,
                           tmpdir: str | None = None, workdir: str = ".",
                           workspace_fd: int | None = None, gid: int | None = None,
                           read_only: bool = False,
                           ro_fds: tuple[tuple[int, str], ...] = (),
                           image: ImageRoot | None = None) -> tuple[Shape, Verified]:
        """Run ``probe.py`` at the end of the chain ``build`` makes for these
        inputs (default limits: the shape does not depend on their values),
        keep what the kernel showed under the chain's shape, and return it."""
        limits = ToolLimits(**DEFAULT_LIMITS)
        marker = f"corral-probe-{secrets.token_hex(8)}"
        command = (probe_in_image(self.python, marker) if image is not None
                   else self.probe_command(marker))
        layer = (await self.image_layer(image, limits, uid, gid, probe=True)
                 if image is not None else None)
        try:
            chain = self.build(command, workspace, limits, network=network,
                               uid=uid, tmpdir=tmpdir, workdir=workdir, call_id="corral-probe",
                               workspace_fd=workspace_fd, gid=gid, read_only=read_only,
                               ro_fds=ro_fds, image=image, layer=layer, probe=image is not None)
            code, out, err, outside, cgroups = await run_probe(chain.argv, chain.env,
                                                               chain.pass_fds, marker)
        finally:
            if layer is not None:
                await asyncio.to_thread(layer.close)
        cg = self.cgroup
        joined = cg is not None and cg.applied and bool(cg.dirs)
        expect = Expect(self.tier, uid, self.user.gid if gid is None else gid, limits, network,
                        cgroup_mark=cg_mark(cg.dirs[0]) if cg is not None and joined else "",
                        cgroup_count=len(cg.procs_files) if cg is not None and joined else 0)
        if code != 0:
            first = (err or out).strip().splitlines()
            why = first[0][:300] if first else f"exit code {code}"
            verified = Verified(expect, None, [f"probe failed: {why}"])
        else:
            try:
                view = replace(KernelView.parse(out), outside=outside, cgroups=cgroups)
            except ValueError as exc:
                verified = Verified(expect, None, [f"probe failed: {exc}"])
            else:
                verified = Verified(expect, view, shortfalls(view, expect, self.host_ns))
        if len(self.verified) >= MAX_SHAPES:  # a bound; a steady worker has a handful
            self.verified.pop(next(iter(self.verified)))
        self.verified[chain.shape] = verified
        return chain.shape, verified

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

    def isolation(self, limits: ToolLimits, *, network: bool, uid: int,
                  shape: Shape | None = None, read_only: bool = False,
                  git_writable: bool = False, gid: int | None = None,
                  image: ImageRoot | None = None) -> IsolationRecord:
        """The record of a shell call as ``uid`` whose chain had ``shape``,
        derived from what the probe of that shape saw. Without a shape (a tool
        error before anything ran), the probed shape with the same grant.
        (``git_writable``: the caller's opt-in; T1/T0 cannot protect ``.git``.)"""
        found = self.verified.get(shape) if shape is not None else next(
            (v for v in self.verified.values() if v.expect.network == network), None)
        degraded = self.degraded()
        protects_git = self.tier in ("T2", "T2-")
        if not git_writable and not protects_git and not read_only:
            degraded.append(".git is writable: this tier cannot bind it read-only")
        mode: SandboxMode = "read-only" if read_only else "workspace-write"
        git_open = not read_only and (git_writable or not protects_git)
        if found is None or found.view is None:
            why = found.problems[0] if found is not None else "this chain was never probed"
            return _with_image(image, IsolationRecord(
                tier=self.tier, filesystem="unverified", network="host", pid_namespace=False,
                seccomp=False, uid=uid, limits=ToolLimits(**limits),
                degraded=[*degraded, f"isolation not verified: {why}"],
                unsandboxed_opt_in=self.unsandboxed_opt_in, kernel=None,
                sandbox_mode=mode, git_writable=git_open))
        view, expect = found.view, found.expect
        # What the probe could write, not what was asked for: its chain started
        # in the workspace as this shape binds it (older probes did not say).
        ws_errno = view.errnos.get("workspace_write", -1)
        if ws_errno >= 0:
            mode = "workspace-write" if ws_errno == 0 else "read-only"
        git_errno = view.errnos.get("git_write", -1)
        if git_errno >= 0:
            git_open = git_errno == 0
        elif ws_errno > 0:
            git_open = False  # nothing of the workspace is writable
        sep = view.separate(self.host_ns)
        write_denied = view.errnos.get("host_write", 0) != 0
        no_ns = not view.seen_ns
        if self.tier in ("T2", "T2-"):
            fs_ok = write_denied and ("mnt" in sep or no_ns)
            # Over an image, the probe's refused write was in the image's "/".
            shown = ("image-root+call-layer+rw-workspace+tmpfs" if image is not None
                     else "ro-system+rw-workspace+tmpfs")
            filesystem = shown if fs_ok else "host"
            closed = "net" in sep or (no_ns and view.interfaces == ["lo"])
        elif self.tier == "T1":
            filesystem = "landlock:ro-host+rw-workspace" if write_denied else "host"
            closed = view.errnos.get("socket_inet", 0) != 0
        else:
            filesystem, closed = "host", False
        net = "none" if closed else ("granted" if network else "host")
        applied = ToolLimits(**limits)
        want = expected_rlimits(expect.limits)
        for name, key in RLIMIT_OF.items():
            if view.rlimits.get(name) != want[name]:
                applied[key] = view.rlimits.get(name, (-1, -1))[0]  # type: ignore[literal-required]
        notes = list(found.problems)
        if no_ns and self.tier != "T0":
            notes.append("namespaces not verified: neither the probe nor the host could read "
                         "them")
        return _with_image(image, IsolationRecord(
            tier=self.tier, filesystem=filesystem, network=net,  # type: ignore[typeddict-item]
            pid_namespace="pid" in sep, seccomp=view.seccomp_in_force,
            uid=uid if set(view.uids) == {expect.uid} else view.uids[1],
            limits=applied, degraded=[*degraded, *notes],
            unsandboxed_opt_in=self.unsandboxed_opt_in,
            kernel=kernel_facts(view, expect, self.host_ns, uid, gid),
            sandbox_mode=mode, git_writable=git_open,
        ))

    def file_isolation(self, limits: ToolLimits, *, read_only: bool = False,
                       git_writable: bool = False,
                       image: ImageRoot | None = None) -> IsolationRecord:
        """The record of a file tool: worker-side, confined by openat2, with the
        file tools' fsuid (the sandbox user's uid, outside the per-call range);
        they refuse writes in read-only mode and under ``.git`` unless opted in."""
        return _with_image(image, IsolationRecord(
            tier=self.tier, filesystem="workspace-openat2", network="none",
            pid_namespace=False, seccomp=False, uid=self.user.uid,
            limits=ToolLimits(**limits), degraded=self.degraded(shell=False),
            unsandboxed_opt_in=self.unsandboxed_opt_in, kernel=None,
            sandbox_mode="read-only" if read_only else "workspace-write",
            git_writable=git_writable and not read_only,
        ))


def _with_image(image: ImageRoot | None, record: IsolationRecord) -> IsolationRecord:
    """``record`` naming the image root the call ran over (as verified on disk)."""
    if image is not None:
        record["image"] = image.record()
    return record
