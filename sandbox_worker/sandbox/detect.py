"""Tier detection by *trying* each layer at worker start-up.

For each tier, the real argv chain (``Profile.build``) is run with the probe
(``probe.py``) as its command, as a per-call uid leased from the pool like any
call's, in a scratch workspace. A tier works when the probe ran to its end and
the kernel showed everything the tier promises (``verify.shortfalls``): for
T2 the seccomp filter in force (Seccomp: 2 and ``unshare(0)`` refused),
NoNewPrivs, the call's uid and gid with no capabilities, the rlimits, the user,
pid, mount, ipc, uts, cgroup and net namespaces separate from the worker's, no
AF_VSOCK socket and no write to a world-writable host directory; T2- the same
without the namespaces (no /proc to read them); T1 the same without
namespaces but with AF_INET refused and Landlock refusing the host write; T0
the uid, NoNewPrivs and rlimits. Nothing is inferred from version numbers.
Every tier is tried, so a forced lower tier (tests, operators) is known to
work too, and what each probe saw is kept (``verified``) so that calls whose
chains have the same shape need no probe of their own.

Invariants: detection never raises for a failing layer; it records why the
layer failed (what the kernel showed short of the tier) so ``info()`` and
refusals can say so.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field

from sandbox_worker.api import Tier
from sandbox_worker.sandbox.launch import landlock_abi
from sandbox_worker.sandbox.profile import TIERS, Profile, Shape, Verified

log = logging.getLogger(__name__)


@dataclass
class Detection:
    working: list[Tier] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)
    landlock_abi: int = 0
    verified: dict[Tier, dict[Shape, Verified]] = field(default_factory=dict)

    @property
    def best(self) -> Tier | None:
        return self.working[0] if self.working else None


async def detect(base: Profile, uid: int | None = None) -> Detection:
    """Try every tier with ``base``'s group, filters and cgroup, as ``uid`` (the
    worker passes a leased per-call uid; default: the sandbox user's uid, for
    stand-alone diagnosis such as the test summary)."""
    if uid is None:
        uid = base.user.uid
    result = Detection()
    for tool in ("setpriv", "prlimit"):
        if shutil.which(tool) is None:
            for tier in TIERS:
                result.failures[tier] = f"{tool} not found (apt-get install util-linux)"
            return result
    result.landlock_abi = landlock_abi()
    scratch = tempfile.mkdtemp(prefix="corral-probe-", dir=base.tmp_root)
    try:
        os.chown(scratch, uid, base.user.gid)
        os.chmod(scratch, 0o700)
        # Bound by fd, as real calls bind their pinned workspace, so the shape
        # probed here is the one calls have.
        scratch_fd = os.open(scratch, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            for tier in TIERS:
                if tier in ("T2", "T2-") and shutil.which("bwrap") is None:
                    result.failures[tier] = "bwrap not found (apt-get install bubblewrap)"
                    continue
                probe = Profile(tier, base.user, base.filters, base.cgroup, base.tmp_root,
                                base.python)
                shape, verified = await probe.verify_chain(scratch, network=False, uid=uid,
                                                           tmpdir=scratch, workspace_fd=scratch_fd)
                if verified.view is not None and not verified.problems:
                    result.working.append(tier)
                    result.verified[tier] = {shape: verified}
                else:
                    why = "; ".join(verified.problems)
                    result.failures[tier] = why[:300]
                    log.info("tier %s does not work here: %s", tier, why)
        finally:
            os.close(scratch_fd)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return result
