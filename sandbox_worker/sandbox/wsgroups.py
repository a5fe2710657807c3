"""One sandbox group per workspace: the gid every tool call of that workspace runs with.

The workspace grant (``workspace.py``) gives a *group* ACL entries on the
workspace tree while calls of it run. With one group for every workspace, anything that handed a
host user that group (a setgid file a tool left behind) or let a call reach
another workspace's path (T1 reads the whole host filesystem) reached every
granted workspace. So each workspace gets a gid of its own, from a range
reserved for Corral (``--workspace-gid-range START:COUNT``, default
``200000:65536``; gids need no /etc/group entries), and its calls run with
that gid only: a call of workspace A has no entry on workspace B.

A workspace is keyed by its identity on this host, ``(st_dev, st_ino)`` of
its root, never by a path. The mapping is kept in a root-only directory
(default ``/var/lib/corral/workspace-groups``, shared by all workers of the
host, persistent): ``ws-<dev>-<ino>`` holds the gid and
``gid-<gid>`` the identity it belongs to. Allocation runs under an exclusive
``flock`` of ``.lock`` in that directory, so two workers never hand one gid to
two workspaces; lookups of a known workspace are one small file read (and an
in-process cache).

Invariants:
- A gid of the range is given to at most one workspace identity.
- Gids of the range are never 0, never an /etc/group gid and never inside an
  /etc/subgid delegation (checked at ``setup``; refused loudly).
- An inode number reused after its workspace was deleted inherits that gid;
  no entry of it is left outside a running call (files moved out of a
  workspace during a call keep theirs: docs/sandbox.md).
"""

from __future__ import annotations

import fcntl
import grp
import os
import threading
from typing import Final

from sandbox_worker.sandbox.errors import WorkspaceUnusable
from sandbox_worker.sandbox.ranges import ID_MAX, RangeKind, check_range, private_dir

DEFAULT_GID_START: Final = 200_000
DEFAULT_GID_COUNT: Final = 65_536
DEFAULT_GROUP_DIR: Final = "/var/lib/corral/workspace-groups"
GID_MAX: Final = ID_MAX
GID_KIND: Final = RangeKind("workspace gid range", "gid", "a group of this host",
                            "/etc/group entries", "/etc/subgid", "--workspace-gid-range")


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read(64).strip()
    except FileNotFoundError:
        return None


class WorkspaceGroups:
    """Gives each workspace identity its own gid (see the module docstring)."""

    def __init__(self, start: int = DEFAULT_GID_START, count: int = DEFAULT_GID_COUNT,
                 directory: str = DEFAULT_GROUP_DIR) -> None:
        self.start = start
        self.count = count
        self.directory = directory
        self.gids = range(start, start + count)
        self._cache: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()

    def setup(self, *, reserved_gids: tuple[int, ...] = ()) -> None:
        """Check the range and create the directory. Blocking."""
        check_range(GID_KIND, self.start, self.count, (g.gr_gid for g in grp.getgrall()),
                    reserved_gids)
        private_dir(self.directory, "workspace group directory")

    def gid_for(self, dev: int, ino: int) -> int:
        """The workspace's gid, allocated on first use. Blocking (a file read;
        a locked allocation the first time)."""
        key = (dev, ino)
        with self._lock:
            cached = self._cache.get(key)
        if cached is not None:
            return cached
        gid = self._lookup_or_allocate(dev, ino)
        with self._lock:
            self._cache[key] = gid
        return gid

    def _lookup_or_allocate(self, dev: int, ino: int) -> int:
        name = os.path.join(self.directory, f"ws-{dev}-{ino}")
        known = _read(name)
        if known is not None and known.isdigit() and int(known) in self.gids:
            return int(known)
        lock = os.open(os.path.join(self.directory, ".lock"),
                       os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            known = _read(name)
            if known is not None and known.isdigit() and int(known) in self.gids:
                return int(known)
            offset = (dev * 1_000_003 + ino) % self.count
            for i in range(self.count):
                gid = self.start + (offset + i) % self.count
                claim = os.path.join(self.directory, f"gid-{gid}")
                try:
                    fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                 0o600)
                except FileExistsError:
                    continue
                try:
                    os.write(fd, f"{dev}-{ino}\n".encode())
                finally:
                    os.close(fd)
                tmp = f"{name}.tmp"
                with open(tmp, "w") as f:
                    f.write(f"{gid}\n")
                os.replace(tmp, name)
                return gid
        finally:
            os.close(lock)
        raise WorkspaceUnusable(
            f"every gid of the workspace gid range {self.start}:{self.count} is taken",
            hint=f"remove the entries of deleted workspaces from {self.directory}, or "
            "widen --workspace-gid-range")

    def info(self) -> dict[str, object]:
        return {"range": [self.start, self.count], "directory": self.directory,
                "known": len(self._cache)}
