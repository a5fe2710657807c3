"""The workspace of one tool call: pinned by identity, granted to its own group, swept after.

``WorkspacePins.open`` turns a request's workspace path into a ``Pinned``
workspace for one call:

1. the path is validated (absolute, not a system directory, under
   ``--workspace-root``) and resolved once (``validate_workspace``);
2. it is opened as root with no symlink followed, and its ``(st_dev,
   st_ino)`` must equal the identity the supervisor recorded when the session
   was created (``workspace_identity`` of the request) or, for a request
   without one, the identity this worker saw at that session's first call
   (``open_pinned``);
3. its own group is looked up (``wsgroups.py``) and, if its root does not
   carry the grant yet, the tree is granted through the pinned fd;
4. unless the call may write ``.git``, every ``.git`` entry known for this
   workspace (its root's, and those the last sweep saw) is opened beneath the
   pinned fd with ``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)``, to be
   bound read-only.

``sweep`` runs after a call that may have changed the workspace: what tools
created is given to the workspace's owner, setid bits are cleared
(``ownership.py``), and the ``.git`` entries seen are remembered.

Invariants:
- No path is resolved after step 2; the grant, the sandbox's bind mounts and
  the file tools all use the pinned fd.
- ``Pinned.close`` closes every fd ``open`` made; the caller calls it.
- The per-session memo and the ``.git`` cache are bounded (``MEMO_MAX``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from sandbox_worker.sandbox.errors import WorkspaceUnusable
from sandbox_worker.sandbox.ownership import SweepReport, normalise
from sandbox_worker.sandbox.resolve import openat2
from sandbox_worker.sandbox.workspace import (
    check_reachable,
    grant_tree,
    is_granted,
    open_pinned,
    validate_workspace,
)
from sandbox_worker.sandbox.wsalias import alias_for
from sandbox_worker.sandbox.wsgroups import WorkspaceGroups

log = logging.getLogger(__name__)

MEMO_MAX: Final = 10_000
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
    git_fds: list[tuple[int, str]] = field(default_factory=list)  # (fd, relative path)

    def close(self) -> None:
        for fd, _ in self.git_fds:
            os.close(fd)
        self.git_fds.clear()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _identity(value: Any) -> Identity | None:
    if isinstance(value, list | tuple) and len(value) == 2 and \
            all(isinstance(v, int) and v >= 0 for v in value):
        return int(value[0]), int(value[1])
    return None


def _open_git(fd: int, rel: str) -> int | None:
    try:
        gfd = openat2(fd, rel, os.O_PATH | os.O_NOFOLLOW)
    except OSError:
        return None
    mode = os.fstat(gfd).st_mode
    if stat.S_ISDIR(mode) or stat.S_ISREG(mode):
        return gfd
    os.close(gfd)
    return None


class WorkspacePins:
    """Pins, grants and sweeps the workspaces of one worker's calls."""

    def __init__(self, groups: WorkspaceGroups, legacy_gid: int, workspace_root: str | None,
                 is_tool_uid: Callable[[int], bool]) -> None:
        self.groups = groups
        self.legacy_gid = legacy_gid
        self.workspace_root = workspace_root
        self.is_tool_uid = is_tool_uid
        self._grant_lock = asyncio.Lock()
        # (session id, workspace path asked for) -> the identity seen at that session's first call
        self._sessions: collections.OrderedDict[tuple[str, str], Identity] = \
            collections.OrderedDict()
        self._git: collections.OrderedDict[Identity, list[str]] = collections.OrderedDict()

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
        fd = await asyncio.to_thread(open_pinned, real, pinned_id)
        try:
            st = os.fstat(fd)
            identity = (st.st_dev, st.st_ino)
            if key not in self._sessions:
                self._remember(key, identity)
            gid = await asyncio.to_thread(self.groups.gid_for, *identity)
            if not is_granted(fd, gid):
                async with self._grant_lock:
                    if not is_granted(fd, gid):
                        report = await asyncio.to_thread(grant_tree, fd, gid,
                                                         (self.legacy_gid,))
                        log.info("granted workspace %s to its group %d (%d entries, %d "
                                 "changed, %d hard-linked files skipped)", real, gid,
                                 report.entries, report.changed, report.skipped_links)
            pinned = Pinned(real, fd, identity, gid)
            if shell:
                # bwrap 0.8 resolves the fd's path again as the call's uid (and
                # checks the result against the fd), and the T1 launcher opens it
                # by path: the parents must be searchable, or the call goes
                # through a group-only alias of the workspace (wsalias.py).
                try:
                    check_reachable(real)
                except WorkspaceUnusable:
                    alias = await asyncio.to_thread(alias_for, fd, gid, identity)
                    afd = await asyncio.to_thread(open_pinned, alias, identity)
                    os.close(fd)
                    fd = pinned.fd = afd
                    pinned.path = alias
        except BaseException:
            os.close(fd)
            raise
        if shell and not git_writable:
            for rel in [".git", *self._git.get(identity, [])]:
                gfd = _open_git(fd, rel)
                if gfd is not None and all(r != rel for _, r in pinned.git_fds):
                    pinned.git_fds.append((gfd, rel))
                elif gfd is not None:
                    os.close(gfd)
        return pinned

    async def sweep(self, pinned: Pinned, started_at: float) -> SweepReport | None:
        """Give what tools created to the owner, clear setid bits, note ``.git``
        entries (never raises: a failed sweep is logged). ``started_at`` is the
        call's start (``time.time()``): only directories changed since then
        are examined, except at this worker's first sweep of the workspace,
        which examines everything (what a dead worker's call may have left)."""
        since = (started_at - SWEEP_SLACK_S) if pinned.identity in self._git else None
        try:
            report = await asyncio.to_thread(normalise, pinned.fd, self.is_tool_uid, since)
        except OSError as exc:
            log.warning("sweep of workspace %s failed: %s", pinned.path, exc)
            return None
        self._git[pinned.identity] = [g for g in report.git if g != ".git"]
        self._git.move_to_end(pinned.identity)
        while len(self._git) > MEMO_MAX:
            self._git.popitem(last=False)
        if report.chowned or report.stripped:
            log.info("workspace %s: %d entries given to its owner, setid bits cleared on %d",
                     pinned.path, report.chowned, report.stripped)
        return report


def refuses_git(path: str) -> bool:
    """True when a workspace-relative path goes through a ``.git`` entry."""
    return ".git" in path.split("/")

