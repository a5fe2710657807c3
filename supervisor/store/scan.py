"""Forensics for tests and operators: which strings reached a database's files on disk.

``scan_db_bytes`` reads the raw bytes of the main database file AND its ``-wal`` (and a
rollback ``-journal`` if one exists) and reports which needles occur, as UTF-8 and in
the JSON-escaped form the store writes. Because the store keeps items as plain
(uncompressed) JSON text, anything the engine ever handed to the store is visible here,
including superseded page images still in the WAL.

Invariant: reads only; safe while the database is open elsewhere (the bytes seen are
whatever has reached the files at that moment).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

_SUFFIXES = ("", "-wal", "-journal")
_CHUNK_BYTES = 4 << 20


def _forms(needle: str) -> set[bytes]:
    escaped = json.dumps(needle, ensure_ascii=False)[1:-1]
    ascii_escaped = json.dumps(needle, ensure_ascii=True)[1:-1]
    return {needle.encode(), escaped.encode(), ascii_escaped.encode()}


def db_files(path: Path) -> list[Path]:
    """The files that hold the database at ``path`` (those that exist)."""
    return [p for p in (Path(f"{path}{s}") for s in _SUFFIXES) if p.exists()]


def scan_db_bytes(path: Path | str, needles: Iterable[str]) -> list[str]:
    """Return the needles found in the database's main, -wal or -journal file bytes."""
    wanted = {n: _forms(n) for n in needles if n}
    if not wanted:
        return []
    longest = max(len(f) for forms in wanted.values() for f in forms)
    found: set[str] = set()
    for file in db_files(Path(path)):
        with file.open("rb") as fh:
            tail = b""
            while True:
                chunk = fh.read(_CHUNK_BYTES)
                if not chunk:
                    break
                window = tail + chunk
                for needle, forms in wanted.items():
                    if needle not in found and any(f in window for f in forms):
                        found.add(needle)
                tail = window[-longest:]
    return [n for n in wanted if n in found]
