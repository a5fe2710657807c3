"""Entry point: ``python -m supervisor --help``."""

import sys

from supervisor.main import main

sys.exit(main())
