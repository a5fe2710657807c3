"""The chaos harness's fault schedule: pure and seeded.

``make_schedule(seed, duration_s, faults)`` returns the same list of
``Fault`` for the same arguments, on any machine: the seed fixes the kinds,
the times (offsets in seconds from the start of the fault phase) and the
target choices (as indices resolved against the live farm when the fault
fires). Provider faults are not scheduled in time: they are written into
the scripted provider's script (``provider_faults``), keyed by the script
entry they hit, so they too are a pure function of the seed. Frame faults
are not scheduled in time either: the broker applies them for the whole run
from its own RNG, seeded with the run's seed (``--faults-seed``).

Coverage: the timed kinds are dealt in rounds, each round a seeded
permutation of every enabled timed kind, and gaps are bounded
(``min_gap_s`` to ``2 * min_gap_s``), so every enabled timed kind is
scheduled by ``coverage_s(kinds, min_gap_s)``; a run at least that long
reaches each one (the harness retries a fault it had to skip, and reports a
kind never injected as a violation, ``faults_reached``).

Window faults (``crash_*``) arm one of the supervisor's crash points
(``supervisor/crashpoints.py``, armed at run time through a file): the
supervisor SIGKILLs itself the next time it reaches that exact place (a
step committed but not yet published, the turn's stopping phase, mid model
stream, mid tool, ...), which a timed kill from outside would almost never
hit. ``interrupt_tool`` interrupts a turn while one of its long tool calls
runs (the cancel path of the sandbox's tree kill).

Invariants:
- Faults are spaced by at least ``min_gap_s`` so each recovery can be
  measured on its own; at most ``max_faults`` are scheduled.
- Only kinds named in ``faults`` appear.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Final

PROCESS_FAULTS: Final = (
    "worker_kill_model",  # SIGKILL a worker while it streams a model answer
    "worker_kill_tool",  # SIGKILL a worker while it runs a tool
    "worker_kill_idle",  # SIGKILL a worker with nothing in flight
    "worker_hang",  # SIGSTOP a worker (the broker must expire it); SIGCONT later
    "broker_kill",  # SIGKILL the broker (the farm restarts it)
    "supervisor_kill",  # SIGKILL the supervisor (the farm restarts it)
    "provider_kill",  # SIGKILL the scripted provider (the farm restarts it, same port)
)
# Crash points armed by the schedule (fault kind -> crashpoints.POINTS name).
WINDOW_POINTS: Final = {
    "crash_publish": "publish",  # a step committed, its events not yet published
    "crash_final_answer": "final_answer",  # the turn's stopping phase
    "crash_model_stream": "model_stream",  # mid model stream
    "crash_tool_running": "tool_running",  # mid tool call
    "crash_model_reply": "model_reply",  # calls requested, none dispatched
    "crash_tool_result": "tool_result",  # a call's output committed, next step not sent
    "crash_compaction": "compaction",  # compacted context held provisionally, not durable
    "crash_approval_wait": "approval_wait",  # an approval request committed, unanswered
}
WINDOW_FAULTS: Final = tuple(WINDOW_POINTS)
CANCEL_FAULTS: Final = ("interrupt_tool",)  # interrupt a turn mid long tool call
FRAME_FAULTS: Final = ("frame_drop", "frame_delay", "frame_duplicate")
PROVIDER_FAULTS: Final = ("provider_429", "provider_500", "provider_hang", "provider_cut")
STORE_FAULTS: Final = ("store_busy", "store_slow")
# Faults of a farm with several brokers; naming one runs the farm with two brokers
# (docs/multihost.md). Not in "all": that stays the one-broker soak.
BROKER_SET_FAULTS: Final = (
    "broker_kill_one",  # SIGKILL one of two brokers (new calls move to the other)
)
# Faults of a farm of several supervisors on one PostgreSQL store (docs/multihost.md);
# naming one runs the farm with 3 supervisors on PostgreSQL (a throwaway cluster).
SUPERVISOR_SET_FAULTS: Final = (
    "supervisor_stop",  # SIGSTOP one supervisor past its lease, then SIGCONT (fencing)
    "pg_restart",  # restart PostgreSQL under load (immediate shutdown, then start)
)
ONE_BROKER_FAULTS: Final = (PROCESS_FAULTS + WINDOW_FAULTS + CANCEL_FAULTS + FRAME_FAULTS
                            + PROVIDER_FAULTS + STORE_FAULTS)
ALL_FAULTS: Final = ONE_BROKER_FAULTS + BROKER_SET_FAULTS + SUPERVISOR_SET_FAULTS


@dataclass(frozen=True, slots=True)
class Fault:
    at_s: float  # offset from the start of the fault phase
    kind: str
    pick: int  # which candidate target (index modulo the live candidates)
    duration_s: float = 0.0  # for hangs, delays and store faults


def parse_faults(spec: str, *, supervisors: int = 1, brokers: int = 1) -> tuple[str, ...]:
    """``all`` or a comma list of kinds (or groups: process, frame, provider, store,
    brokers, supervisors). ``all`` is every kind the farm's shape allows: on one
    supervisor (SQLite) the one-broker kinds; on several (PostgreSQL) the same without
    the SQLite store kinds, plus the supervisor-set kinds; with two brokers, plus
    ``broker_kill_one``. The SQLite store kinds named on a PostgreSQL farm are refused."""
    pg = supervisors > 1
    all_kinds = tuple(k for k in ONE_BROKER_FAULTS if not (pg and k in STORE_FAULTS))
    if pg:
        all_kinds += SUPERVISOR_SET_FAULTS
    if brokers > 1:
        all_kinds += BROKER_SET_FAULTS
    groups = {"process": PROCESS_FAULTS, "window": WINDOW_FAULTS, "cancel": CANCEL_FAULTS,
              "frame": FRAME_FAULTS, "provider": PROVIDER_FAULTS, "store": STORE_FAULTS,
              "brokers": BROKER_SET_FAULTS, "supervisors": SUPERVISOR_SET_FAULTS,
              "all": all_kinds}
    kinds: list[str] = []
    for word in (w.strip() for w in spec.split(",") if w.strip()):
        if word in groups:
            kinds.extend(groups[word])
        elif word in ALL_FAULTS:
            kinds.append(word)
        else:
            raise ValueError(f"unknown fault {word!r}; choose from {', '.join(ALL_FAULTS)} "
                             f"or a group: {', '.join(groups)}")
    if pg and set(kinds) & set(STORE_FAULTS):
        raise ValueError(f"{', '.join(k for k in STORE_FAULTS if k in kinds)}: SQLite store "
                         "faults; a farm of several supervisors runs on PostgreSQL (its "
                         "store fault is pg_restart)")
    return tuple(dict.fromkeys(kinds))


def farm_shape(spec: str, supervisors: int | None,
               brokers: int | None) -> tuple[int, int]:
    """(supervisors, brokers) of the chaos farm: as given, else what the named kinds
    need (a supervisor-set kind: 3 supervisors; a broker-set kind: 2 brokers)."""
    named = set(parse_faults(spec, supervisors=supervisors or 1, brokers=brokers or 1)
                if supervisors and supervisors > 1 else _named(spec))
    n_sup = supervisors or (3 if named & set(SUPERVISOR_SET_FAULTS) else 1)
    n_brk = brokers or (2 if named & set(BROKER_SET_FAULTS) else 1)
    if n_sup < 2 and named & set(SUPERVISOR_SET_FAULTS):
        raise ValueError("supervisor_stop and pg_restart need --supervisors 2 or more")
    if n_brk < 2 and named & set(BROKER_SET_FAULTS):
        raise ValueError("broker_kill_one needs --brokers 2 or more")
    return n_sup, n_brk


def _named(spec: str) -> tuple[str, ...]:
    """The kinds ``spec`` names, SQLite store kinds allowed (the shape decides)."""
    return parse_faults(spec)


def timed_kinds(faults: tuple[str, ...]) -> list[str]:
    return [k for k in faults if k not in PROVIDER_FAULTS and k not in FRAME_FAULTS]


def coverage_s(faults: tuple[str, ...], min_gap_s: float = 2.5) -> float:
    """Offset by which every enabled timed kind has been scheduled at least once."""
    return 2.0 + 2 * min_gap_s * max(0, len(timed_kinds(faults)) - 1)


def make_schedule(seed: int, duration_s: float, faults: tuple[str, ...], *,
                  min_gap_s: float = 2.5, max_faults: int = 20000) -> list[Fault]:
    rng = random.Random(seed)
    timed = timed_kinds(faults)
    out: list[Fault] = []
    if not timed:
        return out
    t = 1.0 + rng.random()
    deck: list[str] = []
    while t < duration_s and len(out) < max_faults:
        if not deck:  # a new round: every enabled kind once, in a seeded order
            deck = rng.sample(timed, len(timed))
        kind = deck.pop()
        duration = 0.0
        if kind == "worker_hang":
            duration = rng.uniform(1.0, 3.0)
        elif kind in STORE_FAULTS or kind == "supervisor_stop":  # stop: past the lease
            duration = rng.uniform(0.5, 2.0)
        out.append(Fault(round(t, 3), kind, rng.randrange(1 << 16), round(duration, 3)))
        t += min_gap_s + rng.uniform(0, min_gap_s)
    return out


def provider_faults(seed: int, entries: int, faults: tuple[str, ...], *,
                    rate: float = 0.15) -> dict[int, dict[str, object]]:
    """Fault fields to merge into script entries, by entry index.

    Each applies to the first attempt only (``times: 1``), so a retry gets the
    real answer and a turn can always complete.
    """
    kinds = [k for k in faults if k in PROVIDER_FAULTS]
    rng = random.Random(seed ^ 0x5EED)
    out: dict[int, dict[str, object]] = {}
    if not kinds:
        return out
    for k in range(entries):
        if rng.random() >= rate:
            continue
        kind = rng.choice(kinds)
        if kind == "provider_429":
            out[k] = {"status": 429, "retry_after_s": 0.2, "times": 1}
        elif kind == "provider_500":
            out[k] = {"status": 500, "times": 1}
        elif kind == "provider_hang":
            out[k] = {"hang": True, "times": 1}
        else:
            out[k] = {"cut_after_bytes": 60 + rng.randrange(200), "times": 1}
    return out
