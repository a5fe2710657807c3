"""Entry point: ``python -m sandbox_worker --help``."""

import sys

from sandbox_worker.main import main

sys.exit(main())
