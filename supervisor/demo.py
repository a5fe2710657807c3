"""``scripts/demo``: the main job. Until the farm demo lands this runs the
foundation demo (broker + echo workers, one SIGKILLed mid-run)."""

from __future__ import annotations

import sys

from broker.demo import main as echo_main


def main(argv: list[str] | None = None) -> int:
    return echo_main(argv)


if __name__ == "__main__":
    sys.exit(main())
