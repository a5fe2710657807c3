"""The chaos harness's workload: a scripted agent whose every side effect can
be counted on disk.

All sessions share one script (the scripted provider is stateless: entry
``k`` answers a request whose input already holds ``k`` model outputs), and
each session works in its own workspace, so entry ``k``'s effects are
unique per workspace:

- a ``shell`` call appends the marker line ``m-K`` to ``effects.log`` (not
  idempotent: a second execution would add a second line);
- a ``write_file`` writes ``files/fK.txt``; every few steps an ``edit_file``
  edits it and a ``read_file`` (idempotent) reads it back.

A turn is ``steps`` tool rounds and one final text answer, so turn ``t``
(from 0) uses entries ``t*(steps+1)`` to ``t*(steps+1)+steps``.

Long calls (the first round of every turn): after its marker, the shell call
leaves a double-forked child that ignores SIGTERM and loops forever
(``chaos-orphan-<run>-<session>-<k>`` in its command line) and runs a
TERM-ignoring ``chaos-long-<run>-<session>-<k>`` for ``LONG_S`` seconds, so
worker kills, hangs and interrupts land mid-call and a tree kill that misses a
process leaves it in the process table. ``<run>-<session>`` is read from the
workspace's ``.chaos-id`` (written by the harness; ``<run>`` is 8 random hex
digits, so runs side by side on one host never mix), so a process names its
run, its session and its call.

Invariant: the script asks for each marker exactly once (``requests_in``).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from supervisor.chaos.schedule import provider_faults

MARKER_RE = re.compile(r"^m-(\d+)$")
TOKEN_RE = re.compile(r"chaos-(long|orphan)-([0-9a-f]{8})-(\d+)-(\d+)")
ID_FILE = ".chaos-id"
LONG_S = 6.0


def long_command(k: int) -> str:
    me = f"$(cat {ID_FILE})-{k}"
    return (f"echo m-{k} >> effects.log && echo running m-{k} && "
            f"( sh -c 'trap \"\" TERM; while :; do sleep 1; done' \"chaos-orphan-{me}\" & ) ; "
            f"sh -c 'trap \"\" TERM; sleep {LONG_S}' \"chaos-long-{me}\"")


def entry_for(k: int, steps: int) -> dict[str, Any]:
    step = k % (steps + 1)
    if step == steps:
        return {"text": f"turn done after step {k}", "usage": {"input": 50 + k, "output": 8}}
    command = long_command(k) if step == 0 else f"echo m-{k} >> effects.log && sleep 0.05"
    calls: list[dict[str, Any]] = [
        {"name": "shell", "arguments": {"command": command}},
        {"name": "write_file", "arguments": {"path": f"files/f{k}.txt",
                                             "content": f"file {k}\nvalue=old\n"}},
    ]
    if step % 2 == 1:
        calls.append({"name": "read_file", "arguments": {"path": "effects.log"}})
    return {"tool_calls": calls, "text": f"step {k}", "chunk_delay_s": 0.01,
            "usage": {"input": 40 + k, "output": 12, "cached_input": 20}}


def make_script(turns: int, steps: int, seed: int, faults: tuple[str, ...], *,
                provider_rate: float = 0.15) -> dict[str, Any]:
    entries = turns * (steps + 1)
    extra = provider_faults(seed, entries, faults, rate=provider_rate)
    responses = []
    for k in range(entries):
        entry = entry_for(k, steps)
        entry.update(extra.get(k, {}))
        responses.append(entry)
    return {"responses": responses}


def write_script(path: Path, turns: int, steps: int, seed: int,
                 faults: tuple[str, ...]) -> Path:
    path.write_text(json.dumps(make_script(turns, steps, seed, faults)))
    return path


def requests_in(script: dict[str, Any]) -> Counter[int]:
    """How many times the script asks for each marker's shell effect."""
    asked: Counter[int] = Counter()
    for entry in script.get("responses", []):
        for call in entry.get("tool_calls") or []:
            m = MARKER_CMD_RE.search(str((call.get("arguments") or {}).get("command", "")))
            if call.get("name") == "shell" and m:
                asked[int(m.group(1))] += 1
    return asked


MARKER_CMD_RE = re.compile(r"echo m-(\d+) >> effects\.log")


def count_markers(workspace: Path) -> Counter[int]:
    """How many times each entry's shell effect happened in ``workspace``."""
    counts: Counter[int] = Counter()
    try:
        text = (workspace / "effects.log").read_text()
    except FileNotFoundError:
        return counts
    for line in text.splitlines():
        m = MARKER_RE.match(line.strip())
        if m:
            counts[int(m.group(1))] += 1
    return counts
