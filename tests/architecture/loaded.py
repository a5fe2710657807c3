"""What a piece of code really loads: the modules in ``sys.modules`` after it runs
in a fresh interpreter (``python -c``, in the repository), for the architecture
tests that keep a process or the CLI's parser light.

One child per distinct snippet per pytest process (cached): the checks on building
``corral``'s parser (no heavy, handler-only or dev module) share one run."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

from tests.architecture.graph import REPO

BUILD_PARSER = "from supervisor.cli import build_parser\nbuild_parser()"


@functools.cache
def loaded_by(code: str) -> frozenset[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport json, sys\n"
                          "print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, timeout=60, cwd=REPO, check=True)
    return frozenset(json.loads(out.stdout.splitlines()[-1]))
