"""How ``corral`` commands print results and errors (one place, one shape).

- ``print_json``: one JSON document per line on stdout, keys sorted, flushed.
- ``say_error``: with ``--json`` the document ``{"ok": false, "error": {kind,
  message}}`` on stdout; otherwise ``corral: MESSAGE`` on stderr. Returns the
  exit code it is given, so a command can ``return say_error(...)``.
"""

from __future__ import annotations

import json
import sys
from argparse import Namespace
from typing import Any

from supervisor.cli.render import clean


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


def say_error(ns: Namespace, kind: str, message: str, code: int) -> int:
    if getattr(ns, "json", False):
        print_json({"ok": False, "error": {"kind": kind, "message": message}})
    else:
        print(f"corral: {clean(message)}", file=sys.stderr)
    return code
