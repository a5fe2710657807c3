"""Id ranges reserved for Corral, and the root-only directories that record their use.

Per-call uids (``uidpool.py``) and workspace gids (``wsgroups.py``) come from
ranges no one else may use: a range is refused at start-up when it is empty
or out of bounds, holds an id of the host's user or group database (or one
the caller reserves, the file tools' own), or overlaps a subordinate range of
``/etc/subuid`` / ``/etc/subgid`` (a user's containers map their ids there).
Both keep their allocation state in a directory shared by the host's
workers, which must be private to the worker's user: anyone else able to
write there could hand out ids or forge records.

Invariants:
- ``check_range`` raises ``SandboxSetupError`` with a one-line fix for every
  refusal; it never changes anything.
- ``private_dir`` creates the directory 0700 and refuses one owned by another
  user or writable by group or others.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from sandbox_worker.sandbox.errors import SandboxSetupError

ID_MAX: Final = 2**31 - 2  # stay clear of (id_t)-1 and of signed-int tools


@dataclass(frozen=True)
class RangeKind:
    """The words of one kind of range, for its messages."""

    what: str  # "sandbox uid range"
    id_name: str  # "uid"
    owner_words: str  # "a user (or the file tools)"
    database: str  # "passwd entries"
    subordinate: str  # "/etc/subuid"
    flag: str  # "--sandbox-uid-range"


def subordinate_ranges(path: str) -> list[tuple[int, int]]:
    """The ``name:start:count`` lines of ``/etc/subuid`` or ``/etc/subgid``."""
    out: list[tuple[int, int]] = []
    with contextlib.suppress(OSError), open(path) as f:
        for line in f:
            parts = line.strip().split(":")
            if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
                out.append((int(parts[1]), int(parts[2])))
    return out


def check_range(kind: RangeKind, start: int, count: int, host_ids: Iterable[int],
                reserved: Iterable[int] = ()) -> None:
    """Refuse a range that is invalid or holds an id someone else uses."""
    if start <= 0 or count <= 0 or start + count - 1 > ID_MAX:
        raise SandboxSetupError(f"{kind.what} {start}:{count} is invalid",
                                hint=f"use START:COUNT within 1..{ID_MAX}")
    ids = range(start, start + count)
    clash = [i for i in reserved if i in ids] + [i for i in host_ids if i in ids]
    if clash:
        raise SandboxSetupError(
            f"{kind.what} {start}:{count} contains {kind.id_name} {clash[0]}, which belongs "
            f"to {kind.owner_words}",
            hint=f"choose a range with no {kind.database}: {kind.flag} START:COUNT")
    for lo, n in subordinate_ranges(kind.subordinate):
        if lo < start + count and start < lo + n:
            raise SandboxSetupError(
                f"{kind.what} {start}:{count} overlaps the subordinate {kind.id_name} range "
                f"{lo}:{n} of {kind.subordinate} (a user's containers)",
                hint=f"choose a disjoint range: {kind.flag} START:COUNT")


def private_dir(path: str, what: str) -> None:
    """Create ``path`` (0700) if needed; refuse one others could write."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
    except OSError as exc:
        raise SandboxSetupError(f"cannot create the {what} {path}: {exc.strerror}",
                                hint="run the worker as root") from exc
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise SandboxSetupError(
            f"{what} {path} must be owned by the worker's user and not group/other-writable",
            hint=f"chmod 700 {path}")
