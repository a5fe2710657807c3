"""The dedicated non-root uid that every tool process runs as.

The worker runs as root; tool processes never do. At start-up the worker
looks up (or creates, with ``useradd --system``) the user ``corral-sandbox``
with its own group and no home or login shell. Operators who cannot add a
user may instead configure a fixed high uid/gid with no passwd entry.

Invariants:
- ``SandboxUser.uid`` and ``.gid`` are never 0 (checked here, refused loudly).
- Creation is idempotent and safe when several workers start at once: a lost
  ``useradd`` race is resolved by looking the name up again.
"""

from __future__ import annotations

import asyncio
import logging
import pwd
import shutil
from dataclasses import dataclass

from sandbox_worker.sandbox.errors import SandboxSetupError

log = logging.getLogger(__name__)
DEFAULT_SANDBOX_USER = "corral-sandbox"


@dataclass(frozen=True)
class SandboxUser:
    name: str  # "" when a fixed uid without a passwd entry is used
    uid: int
    gid: int


def _lookup(name: str) -> SandboxUser | None:
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        return None
    return SandboxUser(name, pw.pw_uid, pw.pw_gid)


def _checked(user: SandboxUser) -> SandboxUser:
    if user.uid == 0 or user.gid == 0:
        raise SandboxSetupError(
            f"sandbox user {user.name or user.uid} has uid/gid 0",
            hint="tool processes must never run as root; configure a non-root user",
        )
    return user


async def ensure_user(name: str = DEFAULT_SANDBOX_USER, *, fixed_uid: int | None = None,
                      fixed_gid: int | None = None) -> SandboxUser:
    """Return the sandbox user, creating it if it does not exist."""
    if fixed_uid is not None:
        return _checked(SandboxUser("", fixed_uid, fixed_gid if fixed_gid is not None
                                    else fixed_uid))
    found = _lookup(name)
    if found is not None:
        return _checked(found)
    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    for attempt in range(5):
        proc = await asyncio.create_subprocess_exec(
            useradd, "--system", "--user-group", "--no-create-home",
            "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin",
            "--comment", "Corral tool sandbox", name,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )
        try:
            async with asyncio.timeout(10):
                _, err = await proc.communicate()
        except TimeoutError:
            proc.kill()
            await proc.wait()
            err = b"useradd timed out"
        found = _lookup(name)
        if found is not None:
            log.info("sandbox user %s is uid %d", name, found.uid)
            return _checked(found)
        # Another worker may hold the passwd lock; back off and look again.
        log.warning("useradd %s failed (attempt %d): %s", name, attempt + 1,
                    err.decode(errors="replace").strip())
        await asyncio.sleep(0.1 * (attempt + 1))
    raise SandboxSetupError(
        f"cannot create the sandbox user {name!r}",
        hint=f"create it: useradd --system --user-group --no-create-home {name}, "
        "or configure a fixed uid with --sandbox-uid",
    )
