"""Keep a bounded, even sample of the checkpoints a chaos run exports.

The farm's directory sink keeps only the newest few checkpoints of each
session (``DirectorySink.keep_per_session``), so after an hour-long run the
export directory holds the last turns' files only (the first soak verified
60 of thousands). ``ExportKeeper.poll`` (called every few seconds while the
farm runs) copies each checkpoint file it has not seen before into its own
directory by reservoir sampling: every file the run exported and the keeper
saw has the same chance of being kept, whenever it was written, and at most
``limit`` copies are ever kept. ``finish`` adds the sink's last files, so
the final turns are always checked.

Invariants: bounded (``limit`` files kept plus the sink's last files;
the set of names seen grows by one short string per export); a file the sink
pruned or replaced while it was being read is skipped, never half-copied
(copies are written to a temporary name and renamed); seeded, so the same run
keeps the same sample.
"""

from __future__ import annotations

import contextlib
import os
import random
from pathlib import Path


class ExportKeeper:
    """Reservoir sample of the files appearing in ``source`` (``*.json``)."""

    def __init__(self, source: Path, dest: Path, limit: int, seed: int) -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self.source, self.dest, self.limit = source, dest, limit
        self.rng = random.Random(seed)
        self.seen: set[str] = set()
        self.kept: list[str] = []

    def poll(self) -> None:
        """Look at the sink once; sample the files not seen before."""
        try:
            names = sorted(p.name for p in self.source.glob("*.json"))
        except OSError:
            return
        for name in names:
            if name in self.seen:
                continue
            data = _read(self.source / name)
            if data is None:
                continue  # pruned while listed: not seen, not counted
            self.seen.add(name)
            n = len(self.seen)
            if len(self.kept) < self.limit:
                self._write(name, data)
                self.kept.append(name)
                continue
            j = self.rng.randrange(n)
            if j < self.limit:
                with contextlib.suppress(FileNotFoundError):
                    (self.dest / self.kept[j]).unlink()
                self._write(name, data)
                self.kept[j] = name

    def finish(self) -> None:
        """After the farm stopped: sample what is new, then add every file the sink
        still holds (the sessions' last checkpoints)."""
        self.poll()
        for p in sorted(self.source.glob("*.json")) if self.source.is_dir() else []:
            if not (self.dest / p.name).exists():
                data = _read(p)
                if data is not None:
                    self._write(p.name, data)

    def _write(self, name: str, data: bytes) -> None:
        self.dest.mkdir(parents=True, exist_ok=True)
        tmp = self.dest / f".{name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.dest / name)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None
