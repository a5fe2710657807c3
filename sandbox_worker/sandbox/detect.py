"""Tier detection by *trying* each layer at worker start-up.

For each tier, the real argv chain (``Profile.build``) is run with a probe
command, as a per-call uid leased from the pool like any call's, in a
scratch workspace; a tier works when the
probe exits 0 and reports what it should. Nothing is inferred from version
numbers. Every tier is tried, so a forced lower tier (tests, operators) is
known to work too.

Probes:
- T2:  ``test -r /proc/self/status`` inside bwrap with --proc and seccomp;
- T2-: ``true`` inside bwrap without --proc;
- T1:  the launcher's ``--probe`` with Landlock and the seccomp filter
       (prints ``landlock=<abi> seccomp=1``);
- T0:  ``true`` through setpriv + prlimit + the launcher, no confinement.

Invariants: detection never raises for a failing layer; it records why the
layer failed (first line of stderr) so ``info()`` and refusals can say so.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field

from sandbox_worker.api import Tier
from sandbox_worker.sandbox.limits import DEFAULT_LIMITS
from sandbox_worker.sandbox.profile import TIERS, Profile
from sandbox_worker.sandbox.reaper import MANAGED_HEADS, spawning

log = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 20.0


@dataclass
class Detection:
    working: list[Tier] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)
    landlock_abi: int = 0

    @property
    def best(self) -> Tier | None:
        return self.working[0] if self.working else None


async def _try(argv: list[str], env: dict[str, str], pass_fds: list[int]) -> tuple[int, str]:
    try:
        with spawning():
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=env, pass_fds=pass_fds,
                start_new_session=True)
            MANAGED_HEADS.add(proc.pid)
    except OSError as exc:
        return 127, f"{argv[0]}: {exc.strerror}"
    finally:
        for fd in pass_fds:
            os.close(fd)
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            out, err = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return 124, "probe timed out"
    finally:
        MANAGED_HEADS.discard(proc.pid)
    text = out.decode(errors="replace") + err.decode(errors="replace")
    return proc.returncode if proc.returncode is not None else 1, text.strip()


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
    scratch = tempfile.mkdtemp(prefix="corral-probe-", dir=base.tmp_root)
    try:
        os.chown(scratch, uid, base.user.gid)
        os.chmod(scratch, 0o700)
        for tier in TIERS:
            if tier in ("T2", "T2-") and shutil.which("bwrap") is None:
                result.failures[tier] = "bwrap not found (apt-get install bubblewrap)"
                continue
            probe = Profile(tier, base.user, base.filters, base.cgroup, base.tmp_root,
                            base.python)
            if tier == "T2":
                command = ["/bin/sh", "-c", "test -r /proc/self/status"]
            else:
                command = ["/bin/true"]
            chain = probe.build(command, scratch, DEFAULT_LIMITS, network=False, uid=uid,
                                tmpdir=scratch)
            if tier == "T1":
                dash = chain.argv.index("--", chain.argv.index("-S"))
                chain.argv[dash:] = ["--probe"]
            code, text = await _try(chain.argv, chain.env, chain.pass_fds)
            if code == 0 and tier == "T1":
                fields = dict(p.split("=", 1) for p in text.split() if "=" in p)
                result.landlock_abi = int(fields.get("landlock", "0") or 0)
                if result.landlock_abi <= 0 or fields.get("seccomp") != "1":
                    code, text = 1, f"landlock/seccomp not applied: {text}"
            if code == 0:
                result.working.append(tier)
            else:
                first = text.splitlines()[0] if text else f"exit code {code}"
                result.failures[tier] = first[:300]
                log.info("tier %s does not work here: %s", tier, first)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return result
