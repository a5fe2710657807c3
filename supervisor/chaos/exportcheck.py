"""Exported checkpoints: each must verify, and each tampered section must not.

For every export file, ``check_file`` runs ``supervisor.export.verify`` on
the document as written, then on one copy per section with one value changed
inside that section only:

- ``logical_resume``: a key added to its ``usage``;
- ``run_records``: a key added to the payload of the run's last event;
- ``snapshot``: a key added to the run snapshot's ``execution`` record.

Each change keeps the document well-formed, so only the digest can catch it:
a tampered copy that still verifies means the digest does not cover that
section. Run as ``python -m supervisor.chaos.exportcheck DIR`` it prints one
JSON object per file (the harness runs it with the farm's environment, so the
verify under test is the one the farm's processes run).

Invariant: never raises on a malformed file; a problem is reported as text.
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supervisor.export import verify

TAMPER_KEY = "chaos_tamper"


def _run(doc: dict[str, Any]) -> dict[str, Any]:
    return dict(doc["content"]["snapshot"]["run_records"][0])


def _tamper_logical(doc: dict[str, Any]) -> None:
    doc["content"]["logical_resume"]["usage"][TAMPER_KEY] = 1


def _tamper_run_records(doc: dict[str, Any]) -> None:
    events = doc["content"]["snapshot"]["run_records"][0]["events"]
    events[-1]["payload"][TAMPER_KEY] = 1


def _tamper_snapshot(doc: dict[str, Any]) -> None:
    doc["content"]["snapshot"]["run_records"][0]["snapshot"]["execution"][TAMPER_KEY] = 1


SECTIONS: dict[str, Callable[[dict[str, Any]], None]] = {
    "logical_resume": _tamper_logical,
    "run_records": _tamper_run_records,
    "snapshot": _tamper_snapshot,
}


def check_doc(doc: Any) -> dict[str, Any]:
    """``{"problems": [...], "tamper_undetected": [section, ...], "tamper_skipped": {...}}``."""
    out: dict[str, Any] = {"problems": verify(doc), "tamper_undetected": [],
                           "tamper_skipped": {}}
    for section, tamper in SECTIONS.items():
        bad = copy.deepcopy(doc)
        try:
            tamper(bad)
        except (KeyError, IndexError, TypeError) as exc:  # the section is not there
            out["tamper_skipped"][section] = f"cannot tamper: {type(exc).__name__} {exc}"
            continue
        if not verify(bad):
            out["tamper_undetected"].append(section)
    return out


def check_file(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return {"problems": [str(exc)], "tamper_undetected": [], "tamper_skipped": {}}
    return check_doc(doc)


def check_dir(export_dir: Path) -> dict[str, dict[str, Any]]:
    files = sorted(export_dir.glob("*.json")) if export_dir.is_dir() else []
    return {f.name: check_file(f) for f in files}


def main(argv: list[str]) -> int:
    print(json.dumps(check_dir(Path(argv[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
