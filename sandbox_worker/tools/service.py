"""The ``tool`` service: the broker handler that validates a tool call, runs it
at the worker's sandbox tier, streams its output and replies with a
``ToolCallResult`` carrying the isolation record.

Start-up (``start``) ensures the sandbox user, checks the per-call uid range,
compiles seccomp once, sets up the worker cgroup, detects the working tiers by
trying them, and refuses
(``TierUnavailable``) when the best one is below ``tier_min`` -- or T0
without ``allow_unsandboxed``.

Invariants:
- Tool errors (bad arguments, unknown tool, paths outside the workspace,
  policy refusals) are ``ToolCallResult``s with ``is_error`` and an
  ``error_kind``; only a malformed request envelope is a broker FAILURE.
  No traceback ever reaches the model or the wire.
- Every result carries the isolation record of what was applied.
- The worker process never runs tool code: shell calls are child process
  trees (``sandbox.process``), file tools are worker code confined by
  openat2 in sandbox-uid threads; the event loop is never blocked.
- Every shell call runs as its own uid leased from the ``UidPool`` for the
  call's whole life and given back only after its process tree is gone
  (``process.run``'s guarantee); file tools run with the sandbox user's
  uid, which is outside the range. Each call runs with its workspace's own
  group (``wsgroups``), which holds ACL entries on that workspace only while
  calls on it run (``acl``, ``wslease``): none is left when the last ends.
  Likewise a workspace's alias mount (``wsalias``) lasts as long as the
  calls through it; those of dead workers' calls go at the next start or
  stop of a worker.
- ``aclose`` cancels the calls still running, which kills their trees.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import posixpath
import time
from dataclasses import dataclass, field
from typing import Any, cast

from broker.errors import HandlerError
from broker.protocol import FailureKind, pack, unpack
from broker.worker import RequestContext
from sandbox_worker.api import (
    SANDBOX_MODES,
    SURROGATES,
    TIER_ORDER,
    TOOL_OUTPUT_BYTES,
    IsolationRecord,
    MalformedRequest,
    Tier,
    ToolCallRequest,
    ToolCallResult,
    ToolLimits,
    ToolOutputChunk,
    ToolSchema,
    decode_tool_request,
    fit_text,
    replace_surrogates,
)
from sandbox_worker.sandbox import wsalias
from sandbox_worker.sandbox.cgroup import WorkerCgroup
from sandbox_worker.sandbox.detect import Detection, detect
from sandbox_worker.sandbox.errors import (
    BadArguments,
    OutsideWorkspace,
    SandboxError,
    TierUnavailable,
    ToolError,
    WorkspaceUnusable,
)
from sandbox_worker.sandbox.images import ImageRoot, ImageRoots
from sandbox_worker.sandbox.limits import DEFAULT_LIMITS, GIB, merge_limits
from sandbox_worker.sandbox.process import StreamName
from sandbox_worker.sandbox.profile import TIERS, Profile, tier_at_least
from sandbox_worker.sandbox.reaper import OrphanReaper
from sandbox_worker.sandbox.seccomp import SeccompFilters
from sandbox_worker.sandbox.uidpool import (
    DEFAULT_LOCK_DIR,
    DEFAULT_UID_COUNT,
    DEFAULT_UID_START,
    UidPool,
    parse_range,
)
from sandbox_worker.sandbox.user import DEFAULT_SANDBOX_USER, SandboxUser, ensure_user
from sandbox_worker.sandbox.wsgroups import (
    DEFAULT_GID_COUNT,
    DEFAULT_GID_START,
    DEFAULT_GROUP_DIR,
    WorkspaceGroups,
)
from sandbox_worker.tools import files
from sandbox_worker.tools.command import command_call
from sandbox_worker.tools.fsops import SandboxFS, check_relative
from sandbox_worker.tools.mcphost import McpHost
from sandbox_worker.tools.pinning import Pinned, WorkspacePins, refuses_git
from sandbox_worker.tools.schemas import SCHEMAS, validate
from sandbox_worker.tools.shell import ShellRun, remove_stale_tmp, render, run_shell

log = logging.getLogger(__name__)

FIXES = {
    "T2": "install bubblewrap (apt-get install bubblewrap) and allow unprivileged user "
          "namespaces (sysctl kernel.unprivileged_userns_clone=1 / "
          "user.max_user_namespaces > 0)",
    "T1": "use a kernel with Landlock enabled (CONFIG_SECURITY_LANDLOCK, lsm=landlock) "
          "and libseccomp (apt-get install libseccomp2)",
    "T0": "install util-linux (setpriv, prlimit)",
}


@dataclass
class ToolServiceConfig:
    tier_min: Tier = "T2"
    allow_unsandboxed: bool = False
    force_tier: Tier | None = None
    limits: ToolLimits = field(default_factory=lambda: ToolLimits(**DEFAULT_LIMITS))
    sandbox_user: str = DEFAULT_SANDBOX_USER
    sandbox_uid: int | None = None  # a fixed uid with no passwd entry, instead of the user
    sandbox_gid: int | None = None
    uid_range_start: int = DEFAULT_UID_START  # per-call uids (uidpool.py)
    uid_range_count: int = DEFAULT_UID_COUNT
    uid_lock_dir: str = DEFAULT_LOCK_DIR
    gid_range_start: int = DEFAULT_GID_START  # one group per workspace (wsgroups.py)
    gid_range_count: int = DEFAULT_GID_COUNT
    group_dir: str = DEFAULT_GROUP_DIR
    workspace_root: str | None = None
    grace_s: float = 2.0
    mcp_idle_s: float = 600.0  # an MCP server idle this long is stopped (mcphost.py)
    cgroup: bool = True
    cgroup_memory_bytes: int = 8 * GIB
    cgroup_pids: int = 2048
    read_limit_bytes: int = 1024 * 1024
    write_limit_bytes: int = 10 * 1024 * 1024
    tmp_root: str = "/var/tmp"
    file_threads: int = 2
    images: str | None = None  # the image store this worker reads (docs/images.md)
    image_source: str | None = None  # a shared store to fetch images it lacks from
    image_roots: bool = True  # False: this worker runs no calls over images


class ToolService:
    """The ``tool`` service handler and its sandbox (one per worker process)."""

    def __init__(self, config: ToolServiceConfig) -> None:
        self.config = config
        self.profile: Profile | None = None
        self.detection: Detection | None = None
        self.fs: SandboxFS | None = None
        self._filters: SeccompFilters | None = None
        self._cgroup: WorkerCgroup | None = None
        self.pins: WorkspacePins | None = None
        self._calls: set[asyncio.Task[Any]] = set()
        self._reaper: OrphanReaper | None = None
        self.pool: UidPool | None = None
        self._flimits = files.FileLimits(config.read_limit_bytes, config.write_limit_bytes)
        self.mcp = McpHost(self)  # the MCP servers this worker holds (mcphost.py)
        self.images = ImageRoots(config.images, config.image_source, config.image_roots)

    # -- life cycle ---------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        # The farm runs with umask 077 (its home is private); tool processes
        # inherit the worker's, and a user's workspace expects the usual one.
        os.umask(0o022)
        user = await ensure_user(cfg.sandbox_user, fixed_uid=cfg.sandbox_uid,
                                 fixed_gid=cfg.sandbox_gid)
        pool = UidPool(cfg.uid_range_start, cfg.uid_range_count, user.gid, cfg.uid_lock_dir)
        await asyncio.to_thread(pool.setup, reserved_uids=(user.uid,))
        self.pool = pool
        groups = WorkspaceGroups(cfg.gid_range_start, cfg.gid_range_count, cfg.group_dir)
        await asyncio.to_thread(groups.setup, reserved_gids=(user.gid,))
        self.pins = pins = WorkspacePins(groups, user.gid, cfg.workspace_root,
                                         lambda uid: uid in pool.uids or uid == user.uid)
        degraded: list[str] = []
        try:
            self._filters = SeccompFilters.compile()
        except SandboxError as exc:
            degraded.append(f"no seccomp filter: {exc}")
        if cfg.cgroup:
            self._cgroup = WorkerCgroup(cfg.cgroup_memory_bytes, cfg.cgroup_pids)
            await asyncio.to_thread(self._cgroup.setup)
        # Remnants of finished calls (bwrap's orphaned namespace inits) are
        # reaped or killed by this process (reaper.py).
        self._reaper = OrphanReaper(pool.uids)
        self._reaper.install()
        base = Profile("T2", user, self._filters, self._cgroup, cfg.tmp_root,
                       extra_degraded=degraded)
        lease = await pool.acquire(timeout_s=30.0)
        try:
            self.detection = await detect(base, lease.uid)
        finally:
            await pool.give_back(lease)
        tier = self._choose_tier(self.detection)
        self.profile = Profile(tier, user, self._filters, self._cgroup, cfg.tmp_root,
                               unsandboxed_opt_in=tier == "T0", extra_degraded=degraded,
                               verified=dict(self.detection.verified.get(tier, {})))
        # Grants calls of dead workers left (a worker SIGKILLed mid-call): after
        # detection, by when their sandboxes have died with their parent.
        revoked = await asyncio.to_thread(pins.recover)
        if revoked:
            log.info("revoked the grants left on %d workspaces by dead workers", revoked)
        await self._sweep_aliases()
        stale = await asyncio.to_thread(remove_stale_tmp, cfg.tmp_root)
        if stale:
            log.info("removed %d per-call tmp dirs left by dead workers", stale)
        if tier in ("T2", "T2-"):
            await self.images.setup()
        else:
            self.images.reason = f"images need tier T2 or T2-; this worker runs at {tier}"
        self.fs = SandboxFS(user.uid, user.gid, cfg.file_threads)
        fsuid, _ = await asyncio.to_thread(self.fs.whoami)
        if fsuid != user.uid:
            raise TierUnavailable(f"file-tool threads run with fsuid {fsuid}, not {user.uid}")
        log.info("tool sandbox ready: tier %s (working: %s), call uids %d+%d, file-tool "
                 "uid %d, gid %d, cgroup %s", tier, ", ".join(self.detection.working) or "none",
                 pool.start, pool.count, user.uid, user.gid,
                 "applied" if self._cgroup and self._cgroup.applied else "not applied")

    @staticmethod
    async def _sweep_aliases() -> None:
        """Detach the workspace aliases no call holds (wsalias.py): at start
        those dead workers left, at stop any this worker's calls left."""
        detached = await asyncio.to_thread(wsalias.sweep)
        if detached:
            log.info("detached %d workspace aliases no call uses", detached)

    def _choose_tier(self, det: Detection) -> Tier:
        cfg = self.config
        why = "; ".join(f"{t}: {msg}" for t, msg in det.failures.items())
        because = f" ({why})" if why else ""
        if cfg.force_tier is not None:
            if cfg.force_tier not in det.working:
                raise TierUnavailable(f"forced tier {cfg.force_tier} does not work here{because}",
                                      hint=f"to get it: {FIXES.get(cfg.force_tier[:2], '')}")
            tier = cfg.force_tier
        elif det.best is None:
            raise TierUnavailable(f"no sandbox tier works here{because}",
                                  hint=f"to fix: {FIXES['T0']}; {FIXES['T2']}")
        else:
            tier = det.best
        if tier == "T0" and not cfg.allow_unsandboxed:
            what = ("tier T0 was forced" if cfg.force_tier == "T0"
                    else f"only T0 (no sandbox) works here{because}")
            raise TierUnavailable(
                f"{what}; T0 runs tools without a sandbox",
                hint=f"to get a sandbox: {FIXES['T2']}; or run unsandboxed on purpose with "
                "--allow-unsandboxed --tier-min T0")
        if not tier_at_least(tier, cfg.tier_min):
            needed = cfg.tier_min[:2]
            raise TierUnavailable(
                f"sandbox tier {tier} is below the minimum {cfg.tier_min}{because}",
                hint=f"to fix: {FIXES.get(needed, FIXES['T2'])}; or lower --tier-min")
        return tier

    async def aclose(self) -> None:
        calls = [t for t in self._calls if not t.done()]
        for task in calls:
            task.cancel()
        if calls:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.grace_s + 5):
                    await asyncio.gather(*calls, return_exceptions=True)
        await self._sweep_aliases()
        await self.mcp.aclose()
        await self.images.aclose()
        if self._reaper is not None:
            self._reaper.close()
            self._reaper = None
        if self.fs is not None:
            await asyncio.to_thread(self.fs.close)
            self.fs = None
        if self._cgroup is not None:
            await asyncio.to_thread(self._cgroup.close)
        if self.pool is not None:
            self.pool.close()
        if self._filters is not None:
            self._filters.close()
            self._filters = None

    def schemas(self) -> list[ToolSchema]:
        return [ToolSchema(**s) for s in SCHEMAS]

    def info(self) -> dict[str, Any]:
        p, d, cg = self.profile, self.detection, self._cgroup
        # What the kernel showed the chosen tier's probe, not the configuration.
        shown = p.isolation(self.config.limits, network=False, uid=p.user.uid) if p else None
        return {
            "tier": p.tier if p else None,
            "tier_min": self.config.tier_min,
            "working_tiers": list(d.working) if d else [],
            "tier_failures": dict(d.failures) if d else {},
            "landlock_abi": d.landlock_abi if d else 0,
            "degraded": p.degraded() if p else [],
            "seccomp": bool(shown and shown["seccomp"]),
            "kernel": shown["kernel"] if shown else None,
            "cgroup": {"applied": bool(cg and cg.applied), "version": cg.version if cg else "",
                       "reason": cg.reason if cg else "disabled"},
            "sandbox_uid": p.user.uid if p else None,  # the file tools' uid
            "sandbox_user": p.user.name if p else None,
            "sandbox_gid": p.user.gid if p else None,
            "sandbox_uid_range": ([self.pool.start, self.pool.count] if self.pool else None),
            "uid_pool": self.pool.info() if self.pool else {},
            "workspace_groups": self.pins.groups.info() if self.pins else {},
            "unsandboxed_opt_in": bool(p and p.unsandboxed_opt_in),
            "tools": [s["name"] for s in SCHEMAS],
            "mcp": self.mcp.info(),
            "images": self.images.info(),
        }

    # -- the handler --------------------------------------------------------
    async def handle(self, ctx: RequestContext) -> bytes:
        task = asyncio.current_task()
        if task is not None:
            self._calls.add(task)
        try:
            return pack(bounded(await self._handle(ctx)))
        finally:
            if task is not None:
                self._calls.discard(task)

    async def _handle(self, ctx: RequestContext) -> ToolCallResult:
        req = self._parse(ctx.body)
        call_id, tool = req["call_id"], req["tool"]
        start = time.monotonic()
        profile = self.profile
        if profile is None:
            raise HandlerError(FailureKind.INTERNAL, "tool service not started", retryable=True)
        # Command tools and MCP servers run as processes of the call, like shell.
        runs_process = tool == "shell" or "command_tool" in req or "mcp" in req
        command_tool: Any = None
        stdin: bytes | None = None
        limits = ToolLimits(**self.config.limits)
        network = False
        read_only = git_writable = False
        pinned: Pinned | None = None
        image: ImageRoot | None = None
        try:
            given: Any = req.get("policy") or {}  # its meaning is checked here: a tool error
            if not isinstance(given, dict):
                raise BadArguments("policy must be an object")
            policy: dict[str, Any] = given
            limits = merge_limits(self.config.limits, policy.get("limits"))
            network = policy.get("network", False) is True
            self._check_policy(profile, policy)
            read_only, git_writable = self._mode_of(policy)
            command_tool = req.get("command_tool")
            digest = policy.get("image")
            if digest is not None:
                # Verified on disk for every call; never the host's root instead.
                image = await asyncio.to_thread(self.images.open, digest)
            if req.get("mcp") is not None:
                return await self.mcp.handle(ctx, cast("dict[str, Any]", req), profile, limits,
                                             network, start, read_only=read_only,
                                             git_writable=git_writable, image=image)
            if command_tool is not None:
                argv, stdin = command_call(command_tool, req["arguments"])
                args = {"command": argv}
            else:
                args = validate(tool, req["arguments"])
            if image is not None and not (tool == "shell" or command_tool is not None):
                args = image_view(args, image, tool)
            if tool in ("write_file", "edit_file"):
                self._check_writable(args, read_only, git_writable)
            pins = self.pins
            if pins is None:
                raise HandlerError(FailureKind.INTERNAL, "tool service not started",
                                   retryable=True)
            pinned = await pins.open(req["workspace"], req["session_id"],
                                     req.get("workspace_identity"),
                                     shell=tool == "shell" or command_tool is not None,
                                     git_writable=git_writable or read_only,
                                     host=req.get("workspace_host"))
            if tool == "shell" or command_tool is not None:
                return await self._shell(ctx, req, profile, args, pinned, limits, network,
                                         start, read_only=read_only, git_writable=git_writable,
                                         stdin=stdin if command_tool is not None else None,
                                         image=image)
            return await self._file_tool(call_id, tool, profile, args, pinned, limits,
                                         start, read_only=read_only, git_writable=git_writable,
                                         image=image)
        except ToolError as exc:
            return self._error(call_id, tool, exc.kind, str(exc), profile, limits, network,
                               start, read_only, git_writable, process=runs_process,
                               image=image)
        except WorkspaceUnusable as exc:
            return self._error(call_id, tool, "workspace_unusable", str(exc), profile,
                               limits, network, start, read_only, git_writable,
                               process=runs_process)
        except SandboxError as exc:
            return self._error(call_id, tool, "sandbox_unavailable", str(exc), profile,
                               limits, network, start, read_only, git_writable,
                               process=runs_process)
        except (asyncio.CancelledError, HandlerError):
            raise
        except Exception:
            # The message boundary: details stay in the local log.
            log.exception("tool call %s (%s) failed unexpectedly", call_id, tool)
            return self._error(call_id, tool, "internal",
                               "internal error in the tool service; see the worker log",
                               profile, limits, network, start, read_only, git_writable,
                               process=runs_process)
        finally:
            if image is not None:
                image.close()
            if pinned is not None and self.pins is not None:
                # Idempotent (a shell call released before its uid went back).
                await asyncio.shield(self.pins.release(pinned))
            elif pinned is not None:
                pinned.close()

    @staticmethod
    def _parse(body: bytes) -> ToolCallRequest:
        """The request, through the one decoder of ``sandbox_worker.api``; a
        malformed envelope is a ``bad_request`` failure (not retryable)."""
        try:
            req = unpack(body)
        except Exception as exc:  # protocol errors: a bad envelope, not a tool error
            raise HandlerError(FailureKind.BAD_REQUEST, f"tool request is not msgpack: {exc}",
                               retryable=False) from exc
        try:
            return decode_tool_request(req)
        except MalformedRequest as exc:
            raise HandlerError(FailureKind.BAD_REQUEST, str(exc), retryable=False) from exc

    def _check_policy(self, profile: Profile, policy: dict[str, Any]) -> None:
        minimum = policy.get("tier_min")
        if minimum is not None:
            if minimum not in TIER_ORDER:
                raise BadArguments(f"policy.tier_min must be one of {', '.join(TIERS)}")
            if not tier_at_least(profile.tier, minimum):
                why = (self.detection.failures.get(minimum, "") if self.detection else "")
                raise ToolError(
                    f"this worker runs tools at tier {profile.tier}, below the required "
                    f"{minimum}{f' ({why})' if why else ''}. To fix: "
                    f"{FIXES.get(str(minimum)[:2], FIXES['T2'])}",
                    kind="tier_below_minimum")
        if profile.tier == "T0" and policy.get("allow_unsandboxed") is False:
            raise ToolError("this worker has no sandbox (T0) and the call's policy does not "
                            "allow unsandboxed execution. To fix: install bubblewrap "
                            "(apt-get install bubblewrap)", kind="tier_below_minimum")

    def _mode_of(self, policy: dict[str, Any]) -> tuple[bool, bool]:
        """(read_only, git_writable) of the call's policy."""
        mode = policy.get("sandbox_mode", "workspace-write")
        if mode not in SANDBOX_MODES:
            raise BadArguments(f"policy.sandbox_mode must be one of {', '.join(SANDBOX_MODES)}")
        git = policy.get("git_writable", False)
        if not isinstance(git, bool):
            raise BadArguments("policy.git_writable must be true or false")
        return mode == "read-only", git

    @staticmethod
    def _check_writable(args: dict[str, Any], read_only: bool, git_writable: bool) -> None:
        if read_only:
            raise ToolError("the session's sandbox mode is read-only: the workspace cannot be "
                            "changed", kind="read_only")
        path = check_relative(args.get("path", ""))
        if not git_writable and refuses_git(path):
            raise ToolError(f"{path!r} is inside .git, which is read-only in the sandbox "
                            "(a repository's config and hooks run on the host); the operator "
                            "can allow it with the session option git_writable",
                            kind="git_protected")

    async def _shell(self, ctx: RequestContext, req: ToolCallRequest, profile: Profile,
                     args: dict[str, Any], pinned: Pinned, limits: ToolLimits, network: bool,
                     start: float, *, read_only: bool, git_writable: bool,
                     stdin: bytes | None = None, image: ImageRoot | None = None
                     ) -> ToolCallResult:
        async def on_chunk(stream: StreamName, data: bytes) -> None:
            await ctx.send_partial(pack(ToolOutputChunk(stream=stream, data=data)))

        pool = self.pool
        if pool is None:
            raise HandlerError(FailureKind.INTERNAL, "tool service not started", retryable=True)
        lease = await pool.acquire(timeout_s=max(0.0, ctx.budget_s() - 1.0))
        try:
            run: ShellRun = await run_shell(
                profile, args, pinned.path, limits, network=network, uid=lease.uid,
                call_id=req["call_id"], remaining_s=ctx.budget_s(), on_chunk=on_chunk,
                grace_s=self.config.grace_s, workspace_fd=pinned.fd, gid=pinned.gid,
                read_only=read_only, ro_fds=tuple(pinned.git_fds), stdin=stdin, image=image)
        finally:
            # run_shell returns (or raises) only once the call's tree is gone: what
            # it left is given to the workspace's owner (and the grant revoked when
            # no other call uses the workspace) before the uid goes back.
            try:
                if self.pins is not None:
                    await asyncio.shield(self.pins.release(pinned))
            finally:
                await pool.give_back(lease)
        o = run.outcome
        applied = ToolLimits(**limits)
        applied["wall_s"] = run.wall_s
        kind: str | None = None
        if o.timed_out:
            outcome = "timeout"
            kind = "timeout"
        elif o.flooded:
            outcome, kind = "error", "output_limit"
        elif o.exit_code == 0:
            outcome = "ok"
        else:
            outcome, kind = "error", ("killed" if o.signal is not None else "nonzero_exit")
        output, cut = render(run, limits)
        result = ToolCallResult(
            call_id=req["call_id"], tool=req["tool"], outcome=outcome,  # type: ignore[typeddict-item]
            is_error=outcome != "ok", output=output, exit_code=o.exit_code,
            signal=o.signal, duration_s=time.monotonic() - start,
            stdout_bytes=o.stdout_bytes, stderr_bytes=o.stderr_bytes,
            truncated=o.truncated or cut,
            isolation=profile.isolation(applied, network=network, uid=lease.uid,
                                        shape=run.shape, read_only=read_only,
                                        git_writable=git_writable, gid=pinned.gid,
                                        image=image))
        if kind is not None:
            result["error_kind"] = kind
        return result

    async def _file_tool(self, call_id: str, tool: str, profile: Profile, args: dict[str, Any],
                         pinned: Pinned, limits: ToolLimits, start: float, *, read_only: bool,
                         git_writable: bool, image: ImageRoot | None = None) -> ToolCallResult:
        fs = self.fs
        if fs is None:
            raise HandlerError(FailureKind.INTERNAL, "tool service closed", retryable=True)
        fsize = int(limits["file_size_bytes"])
        fn: Any
        workspace = pinned.fd
        if args.get(IN_IMAGE) and image is not None:
            workspace = image.fd  # a read outside the workspace, in the image as imported
        if tool == "read_file":
            fn = functools.partial(files.read_file, workspace, args, self._flimits)
        elif tool == "write_file":
            fn = functools.partial(files.write_file, workspace, args, self._flimits, fsize)
        elif tool == "edit_file":
            fn = functools.partial(files.edit_file, workspace, args, self._flimits, fsize)
        else:
            fn = functools.partial(files.list_dir, workspace, args, self._flimits)
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(fs.executor,
                                      functools.partial(fs.run_as_group, pinned.gid, fn))
        try:
            res: files.FileResult = await asyncio.shield(future)
        except asyncio.CancelledError:
            # The thread cannot be stopped: the release (which revokes the
            # grant) must not run while it may still create files.
            await asyncio.wait({future})
            raise
        size = len(res.output.encode("utf-8", errors="replace"))
        return ToolCallResult(
            call_id=call_id, tool=tool, outcome="ok", is_error=False, output=res.output,
            exit_code=None, signal=None, duration_s=time.monotonic() - start,
            stdout_bytes=size, stderr_bytes=0, truncated=res.truncated,
            isolation=profile.file_isolation(limits, read_only=read_only,
                                             git_writable=git_writable, image=image))

    def _error(self, call_id: str, tool: str, kind: str, message: str, profile: Profile,
               limits: ToolLimits, network: bool, start: float, read_only: bool = False,
               git_writable: bool = False, *, process: bool = False,
               image: ImageRoot | None = None) -> ToolCallResult:
        # No process ran for a tool error: the record names the sandbox user's uid.
        git = git_writable
        isolation: IsolationRecord = (
            profile.isolation(limits, network=network, uid=profile.user.uid,
                              read_only=read_only, git_writable=git, image=image)
            if process or tool == "shell" else profile.file_isolation(
                limits, read_only=read_only, git_writable=git, image=image))
        return ToolCallResult(
            call_id=call_id, tool=tool, outcome="error", is_error=True, output=message,
            exit_code=None, signal=None, duration_s=time.monotonic() - start,
            stdout_bytes=0, stderr_bytes=0, truncated=False, isolation=isolation,
            error_kind=kind)


IN_IMAGE = "\0in_image"  # an args key no JSON schema lets through: set here only


def image_view(args: dict[str, Any], image: ImageRoot, tool: str) -> dict[str, Any]:
    """A file tool's arguments in the view the shell has of an image session:
    a relative path is in the workspace (the shell starts there); an absolute
    one under the image's WorkingDir is that path of the workspace; any other
    absolute path is in the image's root, which file tools may read (as
    imported: a shell call's writable layer is its own) but never change."""
    args = {k: v for k, v in args.items() if k != IN_IMAGE}
    path = args.get("path")
    if not isinstance(path, str) or not path.startswith("/"):
        return args
    norm = posixpath.normpath(path)
    base = image.workdir
    if norm == base or norm.startswith(base + "/"):
        return {**args, "path": norm[len(base) + 1:] or "."}
    if tool in ("write_file", "edit_file"):
        raise OutsideWorkspace(f"{path!r} is outside the workspace ({base}); the image's root "
                               "is read-only to file tools, and what a shell call changes "
                               "there lives only for that call (docs/images.md)")
    return {**args, "path": norm.lstrip("/") or ".", IN_IMAGE: True}


_RESULT_CUT = ("\n[... result cut to fit the stored result: {shown} of {total} bytes "
               "shown]")


def bounded(result: ToolCallResult) -> ToolCallResult:
    """Every result leaves the worker with its ``output`` within
    ``TOOL_OUTPUT_BYTES`` as a JSON string (the tools render within it already;
    this is the one place that makes it true for any path, error messages
    included) and without lone surrogates, which the wire cannot carry."""
    output = result["output"]
    if SURROGATES.search(output):
        output = replace_surrogates(output)
    output, cut = fit_text(output, TOOL_OUTPUT_BYTES, _RESULT_CUT)
    if output is not result["output"]:
        result = ToolCallResult(**{**result, "output": output,
                                   "truncated": result["truncated"] or cut})
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("tool sandbox")
    g.add_argument("--tier-min", choices=list(TIERS), default="T2",
                   help="refuse to serve tools below this sandbox tier (default: T2)")
    g.add_argument("--allow-unsandboxed", action="store_true",
                   help="allow T0 (no sandbox); recorded on every result")
    g.add_argument("--force-tier", choices=list(TIERS), default=None,
                   help="use this tier even if a better one works (tests, diagnosis)")
    g.add_argument("--sandbox-user", default=DEFAULT_SANDBOX_USER,
                   help="system user the tools run as (created if missing)")
    g.add_argument("--sandbox-uid", type=int, default=None,
                   help="use this fixed non-root uid (no passwd entry) instead of a user "
                   "for the file tools (shell calls use --sandbox-uid-range)")
    g.add_argument("--sandbox-uid-range", default=f"{DEFAULT_UID_START}:{DEFAULT_UID_COUNT}",
                   metavar="START:COUNT",
                   help="each running shell call gets its own uid from this range, no "
                   "passwd entries needed (default: %(default)s)")
    g.add_argument("--sandbox-uid-lock-dir", default=DEFAULT_LOCK_DIR,
                   help="root-only directory of the per-uid lock files shared by all workers "
                   "of the host (default: %(default)s)")
    g.add_argument("--workspace-gid-range", default=f"{DEFAULT_GID_START}:{DEFAULT_GID_COUNT}",
                   metavar="START:COUNT",
                   help="each workspace gets its own group from this gid range, no "
                   "/etc/group entries needed (default: %(default)s)")
    g.add_argument("--workspace-group-dir", default=DEFAULT_GROUP_DIR,
                   help="root-only directory mapping workspaces to their groups, shared by "
                   "all workers of the host (default: %(default)s)")
    g.add_argument("--workspace-root", default=None,
                   help="only accept workspaces beneath this directory")
    g.add_argument("--tool-wall-s", type=float, default=DEFAULT_LIMITS["wall_s"],
                   help="wall-clock limit of a tool call, seconds (default 120)")
    g.add_argument("--tool-output-bytes", type=int, default=DEFAULT_LIMITS["output_bytes"],
                   help="output cap per stream (default 1 MiB)")
    g.add_argument("--tool-grace-s", type=float, default=2.0,
                   help="SIGTERM-to-SIGKILL grace when a call is cancelled or times out")
    g.add_argument("--mcp-idle-s", type=float, default=600.0,
                   help="an MCP stdio/HTTP server unused this long is stopped, whether or "
                   "not other MCP calls come (default 600)")
    g.add_argument("--no-worker-cgroup", action="store_true",
                   help="do not create the per-worker memory/pids cgroup")
    g.add_argument("--images", default=None, metavar="DIR",
                   help="the image store this worker runs image sessions from (the farm's "
                   "HOME/images, or a local copy); none: no image sessions here")
    g.add_argument("--image-source", default=None, metavar="DIR",
                   help="a farm's image store on shared storage: an image missing from "
                   "--images is copied from here and verified before its first call")
    g.add_argument("--no-images", action="store_true",
                   help="run no tool calls over images on this worker (they go elsewhere)")
    g.add_argument("--cgroup-memory-bytes", type=int, default=8 * GIB,
                   help="memory limit of a tool call's cgroup (default 8 GiB)")
    g.add_argument("--cgroup-pids", type=int, default=2048,
                   help="process limit of a tool call's cgroup (default 2048)")


def config_from_args(ns: argparse.Namespace) -> ToolServiceConfig:
    limits = ToolLimits(**DEFAULT_LIMITS)
    limits["wall_s"] = ns.tool_wall_s
    limits["output_bytes"] = ns.tool_output_bytes
    try:
        uid_start, uid_count = parse_range(ns.sandbox_uid_range)
    except ValueError as exc:
        raise SystemExit(f"--sandbox-uid-range: {exc}") from exc
    try:
        gid_start, gid_count = parse_range(ns.workspace_gid_range)
    except ValueError as exc:
        raise SystemExit(f"--workspace-gid-range: {exc}") from exc
    if not 0 < ns.mcp_idle_s < float("inf"):
        raise SystemExit("--mcp-idle-s must be a number of seconds above 0")
    return ToolServiceConfig(
        tier_min=ns.tier_min, allow_unsandboxed=ns.allow_unsandboxed,
        force_tier=ns.force_tier, limits=limits, sandbox_user=ns.sandbox_user,
        sandbox_uid=ns.sandbox_uid, workspace_root=ns.workspace_root,
        grace_s=ns.tool_grace_s, mcp_idle_s=ns.mcp_idle_s, cgroup=not ns.no_worker_cgroup,
        cgroup_memory_bytes=ns.cgroup_memory_bytes, cgroup_pids=ns.cgroup_pids,
        uid_range_start=uid_start, uid_range_count=uid_count,
        uid_lock_dir=ns.sandbox_uid_lock_dir, gid_range_start=gid_start,
        gid_range_count=gid_count, group_dir=ns.workspace_group_dir,
        images=ns.images, image_source=ns.image_source, image_roots=not ns.no_images)


__all__ = ["SandboxUser", "ToolService", "ToolServiceConfig", "add_arguments",
           "config_from_args"]
