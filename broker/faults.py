"""Fault injection for chaos runs: drop, delay or duplicate broker frames.

Off unless the broker is started with ``--faults`` (only ``corral chaos``
does that). Pure: ``FrameFaults.decide(now)`` says what to do with the next
routed message, from a seeded RNG, so a chaos run's frame faults follow its
seed. Only request traffic (REQUEST, PARTIAL, REPLY, FAILURE) is touched:
heartbeats stay exact, so liveness keeps its meaning while the messages it
protects are mangled.

What each fault exercises:
- ``frame_drop``: a REQUEST or answer that never arrives; callers must end
  on their deadline (``timeout``), never hang.
- ``frame_duplicate``: an answer delivered twice to the broker; the second
  must be dropped (never delivered twice to the client).
- ``frame_delay``: reordering in time; answers arrive late but once.

Invariant: with no kinds enabled, ``decide`` always returns ``PASS``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Final

KINDS: Final = ("frame_drop", "frame_delay", "frame_duplicate")
PASS: Final = "pass"
DROP: Final = "drop"
DUPLICATE: Final = "duplicate"
DELAY: Final = "delay"


@dataclass
class FrameFaults:
    kinds: frozenset[str]
    rate: float = 0.02
    delay_s: float = 0.2
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown frame fault(s) {sorted(unknown)}; choose from {KINDS}")
        if not 0.0 <= self.rate <= 0.5:
            raise ValueError("frame fault rate must be between 0 and 0.5")
        self._rng = random.Random(self.seed)
        self._choices = sorted(self.kinds)
        self.counts: dict[str, int] = {DROP: 0, DUPLICATE: 0, DELAY: 0}

    @classmethod
    def parse(cls, spec: str | None, *, seed: int = 0) -> FrameFaults | None:
        """``"frame_drop,frame_delay"`` (optionally ``...:rate=0.05``) or None."""
        if not spec:
            return None
        head, _, opts = spec.partition(":")
        kinds = frozenset(k.strip() for k in head.split(",") if k.strip())
        rate = 0.02
        for opt in filter(None, opts.split(";")):
            key, _, value = opt.partition("=")
            if key == "rate":
                rate = float(value)
            else:
                raise ValueError(f"unknown frame fault option {key!r}")
        return cls(kinds, rate=rate, seed=seed)

    def decide(self) -> str:
        if not self._choices or self._rng.random() >= self.rate:
            return PASS
        kind = self._rng.choice(self._choices)
        action = {"frame_drop": DROP, "frame_duplicate": DUPLICATE, "frame_delay": DELAY}[kind]
        self.counts[action] += 1
        return action
