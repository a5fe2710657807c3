"""Entry point: ``python -m supervisor.cli`` is the ``corral`` command."""

import sys

from supervisor.cli.app import main

sys.exit(main())
