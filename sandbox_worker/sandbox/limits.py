"""Per-call resource limits: defaults, validation, merging and the prlimit argv.

A call's limits are the worker's defaults overridden by the request's
``ToolPolicy.limits`` (and, for ``shell``, its ``timeout_s`` argument), each
clamped to the worker's ceiling. The effective limits are what the isolation
record reports, so what is recorded is what was applied.

Invariants:
- Every limit has a default and a ceiling; a request can lower a limit
  freely but never raise it above the ceiling.
- Values are validated here (type and range); a bad value is a
  ``BadArguments`` tool error, never a crash.
"""

from __future__ import annotations

import math
from typing import Any, Final

from sandbox_worker.api import ToolLimits
from sandbox_worker.sandbox.errors import BadArguments

MIB: Final = 1024 * 1024
GIB: Final = 1024 * MIB

DEFAULT_LIMITS: Final[ToolLimits] = ToolLimits(
    wall_s=120.0,
    cpu_s=60,
    address_space_bytes=4 * GIB,
    processes=256,
    file_size_bytes=1 * GIB,
    open_files=1024,
    output_bytes=1 * MIB,
    tmpfs_bytes=256 * MIB,
)
CEILING_LIMITS: Final[ToolLimits] = ToolLimits(
    wall_s=3600.0,
    cpu_s=3600,
    address_space_bytes=64 * GIB,
    processes=4096,
    file_size_bytes=64 * GIB,
    open_files=65536,
    # Two streams at the ceiling must still fit one broker message (16 MiB).
    output_bytes=4 * MIB,
    tmpfs_bytes=8 * GIB,
)
# Smallest values that still let bash start; lower ones are rejected so that
# "the command failed" is never confused with "the limit made exec impossible".
FLOOR_LIMITS: Final[dict[str, float]] = {
    "wall_s": 0.05,
    "cpu_s": 1,
    "address_space_bytes": 64 * MIB,
    "processes": 8,
    "file_size_bytes": 1,
    "open_files": 16,
    "output_bytes": 1024,
    "tmpfs_bytes": 1 * MIB,
}


def merge_limits(base: ToolLimits, override: Any, ceiling: ToolLimits = CEILING_LIMITS,
                 ) -> ToolLimits:
    """``base`` overridden by ``override`` (a request's dict), validated and clamped."""
    out = ToolLimits(**base)
    if override is None:
        return out
    if not isinstance(override, dict):
        raise BadArguments("policy.limits must be an object")
    for key, value in override.items():
        if key not in DEFAULT_LIMITS:
            raise BadArguments(f"unknown limit {key!r}; known: {', '.join(DEFAULT_LIMITS)}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise BadArguments(f"limit {key!r} must be a number")
        if not math.isfinite(value) or value < FLOOR_LIMITS[key]:
            raise BadArguments(f"limit {key!r} must be at least {FLOOR_LIMITS[key]}")
        top = ceiling[key]  # type: ignore[literal-required]
        clamped = min(value, top)
        out[key] = float(clamped) if key == "wall_s" else int(clamped)  # type: ignore[literal-required]
    return out


def prlimit_argv(limits: ToolLimits) -> list[str]:
    """``prlimit`` options applying ``limits`` (soft CPU limit sends SIGXCPU, hard +1 s kills)."""
    cpu = int(limits["cpu_s"])
    return [
        "prlimit",
        f"--cpu={cpu}:{cpu + 1}",
        f"--as={limits['address_space_bytes']}",
        f"--nproc={limits['processes']}",
        f"--fsize={limits['file_size_bytes']}",
        f"--nofile={limits['open_files']}",
        "--core=0",
        "--",
    ]
