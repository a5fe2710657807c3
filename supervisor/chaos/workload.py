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
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from supervisor.chaos.schedule import provider_faults

MARKER_RE = re.compile(r"^m-(\d+)$")


def entry_for(k: int, steps: int) -> dict[str, Any]:
    step = k % (steps + 1)
    if step == steps:
        return {"text": f"turn done after step {k}", "usage": {"input": 50 + k, "output": 8}}
    calls: list[dict[str, Any]] = [
        {"name": "shell", "arguments": {"command": f"echo m-{k} >> effects.log && sleep 0.05"}},
        {"name": "write_file", "arguments": {"path": f"files/f{k}.txt",
                                             "content": f"file {k}\nvalue=old\n"}},
    ]
    if step % 2 == 1:
        calls.append({"name": "read_file", "arguments": {"path": "effects.log"}})
    return {"tool_calls": calls, "text": f"step {k}", "chunk_delay_s": 0.01,
            "usage": {"input": 40 + k, "output": 12, "cached_input": 20}}


def make_script(turns: int, steps: int, seed: int, faults: tuple[str, ...]) -> dict[str, Any]:
    entries = turns * (steps + 1)
    extra = provider_faults(seed, entries, faults)
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
