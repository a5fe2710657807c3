"""One tool call's workspace: pinned by identity, granted to its group for the call, released after.

``WorkspacePins.open`` turns a request's workspace path into a ``Pinned``
workspace for one call:

1. the path is validated (absolute, not a system directory, under
   ``--workspace-root``) and resolved once (``validate_workspace``);
2. it is opened as root with no symlink followed, and its ``(st_dev,
   st_ino)`` must equal the identity the supervisor recorded when the session
   was created (``workspace_identity`` of the request) or, for a request
   without one, the identity this worker saw at that session's first call
   (``open_pinned``);
3. its own group is looked up (``wsgroups.py``), the workspace's use file is
   held shared (``wslease.py``; waits while a revoke runs) and the tree is
   granted to the group through the pinned fd (``workspace.grant_tree``);
4. unless the call may write ``.git``, every ``.git`` entry known for this
   workspace (its root's, those the last release's walk saw, and those this
   call's grant walked past) is opened beneath the
   pinned fd with ``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)``, to be
   bound read-only.

``release`` runs once the call's processes are gone (and before a shell
call's uid is given back): if no other call of the workspace holds its use
file, the whole tree is walked -- what tools created given to the owner,
setid bits cleared, every ACL entry Corral added removed (``ownership.
release``); otherwise only what this call created is given to the owner
(``ownership.normalise``) and the grant stays for the calls still running,
the last of which revokes. ``recover`` (worker start-up) revokes what calls
of dead workers left granted.

Invariants:
- No path is resolved after step 2 for a call; the grant, the sandbox's bind
  mounts and the file tools all use the pinned fd.
- Every ``open`` is followed by one ``release`` (idempotent), which closes
  every fd ``open`` made; the caller calls it, shielded from cancellation.
- The per-session memo and the ``.git`` cache are bounded (``MEMO_MAX``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from sandbox_worker.sandbox import wsalias, wslease
from sandbox_worker.sandbox.errors import WorkspaceUnusable
from sandbox_worker.sandbox.ownership import MAX_GIT_DIRS, SweepReport, normalise, release
from sandbox_worker.sandbox.resolve import openat2
from sandbox_worker.sandbox.workspace import (
    check_reachable,
    grant_tree,
    open_pinned,
    validate_workspace,
)
from sandbox_worker.sandbox.wsgroups import WorkspaceGroups

log = logging.getLogger(__name__)

MEMO_MAX: Final = 10_000
MAX_DIR_BINDS: Final = 128  # directories bound over themselves above nested .git entries
RECOVER_MAX: Final = 1_000  # workspaces revoked at start-up (the rest at their next call)
# Directory mtimes come from the kernel's coarse clock (and, on NFS, the
# server's): look at directories changed a little before the call began too.
SWEEP_SLACK_S: Final = 2.0
Identity = tuple[int, int]


@dataclass
class Pinned:
    """One call's workspace: its resolved path, pinned fd, identity and group."""

    path: str
    fd: int
    identity: Identity
    gid: int
    root_fd: int = -1  # the pinned workspace itself (``fd`` may be its alias)
    # (fd, relative path) bound read-only over the workspace at T2: each .git
    # entry, and before them ("dir/", bound read-write over itself) the
    # directories a nested one is in
    git_fds: list[tuple[int, str]] = field(default_factory=list)
    git_seen: list[str] = field(default_factory=list)  # .git entries this call's grant walked
    lease_fd: int = -1  # the workspace's use file, held shared (wslease.py)
    alias: wsalias.Alias | None = None  # the way in for shell, held shared (wsalias.py)
    started_at: float = 0.0  # time.time() before the grant: compared with directory mtimes

    def close(self) -> None:
        for fd, _ in self.git_fds:
            os.close(fd)
        self.git_fds.clear()
        for name in ("fd", "root_fd", "lease_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)
        if self.alias is not None and self.alias.lock_fd >= 0:
            os.close(self.alias.lock_fd)  # not released: a sweep detaches it
            self.alias.lock_fd = -1


def _identity(value: Any) -> Identity | None:
    if isinstance(value, list | tuple) and len(value) == 2 and \
            all(isinstance(v, int) and v >= 0 for v in value):
        return int(value[0]), int(value[1])
    return None


def _open_git(fd: int, rel: str, *, directory: bool = False) -> int | None:
    """``rel`` beneath ``fd`` (no symlink followed), if it is a directory or
    (unless ``directory``) a regular file."""
    try:
        gfd = openat2(fd, rel, os.O_PATH | os.O_NOFOLLOW)
    except OSError:
        return None
    mode = os.fstat(gfd).st_mode
    if stat.S_ISDIR(mode) or (stat.S_ISREG(mode) and not directory):
        return gfd
    os.close(gfd)
    return None


def _keep(pinned: Pinned, fd: int, rel: str) -> bool:
    """Add ``(fd, rel)`` to the call's binds unless ``rel`` is there already
    (then ``fd`` is closed)."""
    if any(r == rel for _, r in pinned.git_fds):
        os.close(fd)
        return False
    pinned.git_fds.append((fd, rel))
    return True


class WorkspacePins:
    """Pins, grants and sweeps the workspaces of one worker's calls."""

    def __init__(self, groups: WorkspaceGroups, legacy_gid: int, workspace_root: str | None,
                 is_tool_uid: Callable[[int], bool]) -> None:
        self.groups = groups
        self.legacy_gid = legacy_gid
        self.workspace_root = workspace_root
        self.is_tool_uid = is_tool_uid
        # (session id, workspace path asked for) -> the identity seen at that session's first call
        self._sessions: collections.OrderedDict[tuple[str, str], Identity] = \
            collections.OrderedDict()
        self._git: collections.OrderedDict[Identity, list[str]] = collections.OrderedDict()

    def is_ours(self, gid: int) -> bool:
        """A gid whose ACL entries Corral adds: a workspace group's, or the old
        shared sandbox group's."""
        return gid in self.groups.gids or gid == self.legacy_gid

    def _pin_for(self, key: tuple[str, str], given: Any, host: Any) -> Identity | None:
        identity = _identity(given)
        if identity is not None and (host is None or host == socket.gethostname()):
            return identity
        return self._sessions.get(key)

    def _remember(self, key: tuple[str, str], identity: Identity) -> None:
        self._sessions[key] = identity
        self._sessions.move_to_end(key)
        while len(self._sessions) > MEMO_MAX:
            self._sessions.popitem(last=False)

    async def open(self, path: str, session_id: str, given_identity: Any, *,
                   shell: bool, git_writable: bool, host: Any = None) -> Pinned:
        real = validate_workspace(path, self.workspace_root)
        key = (session_id, path)  # the path asked for: it may now resolve elsewhere
        pinned_id = self._pin_for(key, given_identity, host)
        # One thread for the whole set-up, awaited to its end even when the call
        # is cancelled: a grant still running when the release revokes would
        # leave entries behind, and a lock taken after we stopped waiting would
        # never be let go.
        task = asyncio.ensure_future(asyncio.to_thread(self._open, real, pinned_id, shell))
        try:
            pinned = await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait({task})
            if not task.cancelled() and task.exception() is None:
                await asyncio.shield(self.release(task.result()))
            raise
        identity = pinned.identity
        if key not in self._sessions:
            self._remember(key, identity)
        fd = pinned.fd
        if shell and not git_writable:
            # The grant's walk saw this call's tree: a nested repository is bound
            # at a worker's first call of the workspace too, not only after a
            # release's walk noted it.
            gits = [rel for rel in dict.fromkeys([".git", *self._git.get(identity, []),
                                                  *pinned.git_seen])
                    if (gfd := _open_git(fd, rel)) is not None and _keep(pinned, gfd, rel)]
            # A nested repository's directories, from the workspace down, each
            # bound over itself (read-write) before its .git: a mount point
            # cannot be renamed, so no call can move the repository aside and
            # put a directory of its own, with a .git of its own, in its place
            # (the user's next git command there would run its hooks).
            # Shallowest first, at most MAX_DIR_BINDS (each is an fd the worker
            # holds for the call and a mount): a call that made 64 chains of 40
            # directories with a .git at each end had the next call hold 2,470.
            for rel in sorted({"/".join(g.split("/")[:i]) for g in gits
                               for i in range(1, g.count("/") + 1)},
                              key=lambda r: (r.count("/"), r))[:MAX_DIR_BINDS]:
                dfd = _open_git(fd, rel, directory=True)
                if dfd is not None:
                    _keep(pinned, dfd, rel + "/")
            # The .git entries after the directories they are in.
            pinned.git_fds.sort(key=lambda e: not e[1].endswith("/"))
        return pinned

    def _open(self, real: str, pinned_id: Identity | None, shell: bool) -> Pinned:
        """Pin, take the use file, grant, alias when needed. Blocking; on an
        error everything taken is released before it is raised."""
        fd = open_pinned(real, pinned_id)
        pinned: Pinned | None = None
        try:
            st = os.fstat(fd)
            identity = (st.st_dev, st.st_ino)
            gid = self.groups.gid_for(*identity)
            pinned = Pinned(real, fd, identity, gid, root_fd=os.dup(fd), started_at=time.time())
            pinned.lease_fd = wslease.acquire(self.groups.directory, identity, real)
            report = grant_tree(fd, gid, self.is_ours)
            pinned.git_seen = report.git
            if not report.complete and not report.read_only_fs:
                log.warning("workspace %s: granted only its first %d entries", real,
                            report.entries)
            if shell:
                # bwrap 0.8 resolves the fd's path again as the call's uid (and
                # checks the result against the fd), and the T1 launcher opens it
                # by path: the parents must be searchable, or the call goes
                # through a group-only alias of the workspace (wsalias.py).
                try:
                    check_reachable(real)
                except WorkspaceUnusable:
                    pinned.alias = alias = wsalias.alias_for(fd, gid, identity)
                    pinned.fd = open_pinned(alias.path, identity)
                    os.close(fd)
                    pinned.path = alias.path
        except BaseException:
            if pinned is None:
                os.close(fd)
            else:
                try:
                    self._release(pinned, full=True)
                finally:
                    pinned.close()
            raise
        return pinned

    async def release(self, pinned: Pinned) -> SweepReport | None:
        """End the call's use of its workspace (see the module docstring) and
        close its fds; idempotent, never raises (a failed walk is logged and
        the use file stays marked granted, for the next call or start-up).
        The partial sweep examines only directories changed since the call
        began, except at this worker's first sweep of the workspace. Call it
        shielded, once the call's processes are gone."""
        if pinned.lease_fd < 0:
            pinned.close()
            return None
        try:
            report = await asyncio.to_thread(self._release, pinned,
                                             full=pinned.identity not in self._git)
        finally:
            pinned.close()
        if report is not None:
            self._note_git(pinned.identity, report, pinned.git_seen)
        return report

    def _release(self, pinned: Pinned, *, full: bool) -> SweepReport | None:
        root = pinned.root_fd if pinned.root_fd >= 0 else pinned.fd
        if pinned.alias is not None:
            try:
                wsalias.release(pinned.alias)  # the last call through it detaches it
            except OSError as exc:
                log.warning("release of the alias %s failed: %s", pinned.alias.path, exc)
        try:
            if wslease.try_exclusive(pinned.lease_fd):
                report = release(root, self.is_tool_uid, self.is_ours)
                if report.complete:
                    wslease.mark_clean(pinned.lease_fd)
            else:
                since = None if full else pinned.started_at - SWEEP_SLACK_S
                report = normalise(root, self.is_tool_uid, since, (pinned.gid, self.is_ours))
        except OSError as exc:
            log.warning("release of workspace %s failed: %s", pinned.path, exc)
            return None
        if report.chowned or report.stripped:
            log.info("workspace %s: %d entries given to its owner, setid bits cleared on %d",
                     pinned.path, report.chowned, report.stripped)
        return report

    def _note_git(self, identity: Identity, report: SweepReport, seen: list[str]) -> None:
        found = [g for g in report.git if g != ".git"]
        if not report.complete:
            # The walk stopped at its bound: a repository it did not reach is
            # still there (a call that filled the tree with entries walked
            # first made the next calls forget it, and left it unbound).
            found = list(dict.fromkeys([*found, *self._git.get(identity, []),
                                        *(g for g in seen if g != ".git")]))[:MAX_GIT_DIRS]
        self._git[identity] = found
        self._git.move_to_end(identity)
        while len(self._git) > MEMO_MAX:
            self._git.popitem(last=False)

    def recover(self) -> int:
        """Revoke the grants calls of dead workers left (their use files marked
        granted, held by nobody), at most ``RECOVER_MAX``. Blocking; run at
        start-up, before any call. Returns how many workspaces were revoked."""
        done = 0
        for fd, identity, path in wslease.left_granted(self.groups.directory, RECOVER_MAX):
            try:
                try:
                    root = open_pinned(path, identity)
                except WorkspaceUnusable as exc:
                    # Gone (its entries with it) or moved: nothing to reach by path.
                    log.warning("granted workspace %s left by a dead call is not reachable "
                                "(%s); its entries stay until it is used again", path, exc)
                    wslease.mark_clean(fd)
                    continue
                try:
                    report = release(root, self.is_tool_uid, self.is_ours)
                finally:
                    os.close(root)
                if report.complete:
                    wslease.mark_clean(fd)
                done += 1
                log.info("revoked the grant a dead worker's call left on %s (%d entries, %d "
                         "changed, %d given to the owner)", path, report.entries,
                         report.revoked, report.chowned)
            except OSError as exc:
                log.warning("revoking the grant left on workspace %s failed: %s", path, exc)
            finally:
                os.close(fd)
        return done


def refuses_git(path: str) -> bool:
    """True when a workspace-relative path goes through a ``.git`` entry."""
    return ".git" in path.split("/")

