"""Planted bugs for ``corral chaos --plant NAME``: the checker's self-test.

In the spirit of FoundationDB's BUGGIFY, a plant makes the product's own code
take one known-bad path, so that ``corral chaos`` can show it finds that bug
from what it observes (events, the store, the disk, the process table). Each
switch is a one-line guard at the single place the bad path is taken, marked
``# chaos plant``.

How a process learns its plants: the variable ``CORRAL_CHAOS_PLANTS`` (a
comma list of names), read once, at import. Only the chaos harness sets it,
and only in the environment of the farm children it starts; the farm itself
(``supervisor.farm.root.Farm``, used by ``corral up``, ``corral run`` and the
harness) refuses to start when the variable is set in its own environment, so
a normal farm can never run planted code.

Invariants:
- With the variable unset, every ``ACTIVE`` test is a constant ``False``
  (a frozenset membership test on an empty set).
- An unknown name is refused at import (``ValueError``): a typo can never
  silently turn a self-test into a clean run.
"""

from __future__ import annotations

import os
from typing import Final

ENV: Final = "CORRAL_CHAOS_PLANTS"

# name -> the bad behaviour it switches on (listed by ``corral chaos --help``)
PLANTS: Final[dict[str, str]] = {
    "rerun_after_restart": "after a supervisor restart, tool calls that were in flight "
                           "are dispatched again",
    "publish_before_commit": "events reach subscribers before their commit",
    "lost_call_as_timeout": "a dead worker's in-flight requests are left to time out "
                            "instead of failing as worker_lost",
    "no_tree_kill": "a cancel or a worker's death kills only the tool's direct child",
    "double_turn_end": "a turn resumed in its stopping phase ends twice",
    "export_digest_partial": "the export digest leaves out the run records",
    "epoch_reused": "a session's lease taken by another supervisor keeps its epoch: "
                    "the fencing token does not change with the owner",
    "usage_double_retry": "a model step that needed a retry counts its answer's usage "
                          "twice",
    "compaction_drops_user": "a compaction keeps every recent user message but the newest",
    "replay_overlap": "a subscription replays from two events before the sequence the "
                      "client asked for (the events it already has, sent again)",
    "export_drops_message": "an export's transcript leaves out the newest assistant "
                            "message (the digest covers what it holds, so it verifies)",
}


def parse(spec: str) -> frozenset[str]:
    """``a,b`` -> {a, b}; raises ``ValueError`` naming an unknown plant."""
    names = frozenset(w.strip() for w in spec.split(",") if w.strip())
    unknown = sorted(names - PLANTS.keys())
    if unknown:
        raise ValueError(f"{ENV}: unknown plant(s) {', '.join(unknown)}; "
                         f"known: {', '.join(PLANTS)}")
    return names


ACTIVE: Final[frozenset[str]] = parse(os.environ.get(ENV, ""))


def on(name: str) -> bool:
    """Whether plant ``name`` is active in this process (fixed at import)."""
    if name not in PLANTS:  # a misspelt switch in the code would never fire
        raise KeyError(f"no plant named {name!r}")
    return name in ACTIVE
