"""The ``corral`` command line: one parser, one small module per command group.

Every command has ``--help``; long work shows progress; ``--json`` gives one
JSON document (or one JSON event per line for streams) for scripts; errors
say what to do next and exit non-zero (the codes are in ``common.py``).

Modules, leaves first (no module imports one listed after it, pinned by
tests/architecture/test_cli_package.py):

- ``common``: exit codes, the handler type, the shared options;
- ``render``: the human renderer that escapes every control character;
- ``output``: JSON and error output;
- ``reach``: reaching the running farm's supervisor;
- command groups, each declaring its sub-parsers bound to their handlers:
  ``lifecycle`` (init, up, down, status), ``run`` (run, attach, approve at
  the terminal), ``control`` (approve, interrupt), ``sessions`` (sessions,
  show, terminate, delete: the store read-only), ``checkpoints`` (export,
  verify, import), ``storecmd`` (store migrate), ``remote`` (keys, worker),
  ``completion``, ``dev``
  (fake-llm, chaos: dev tooling, imported only when run);
- ``parser``: ``build_parser``, the groups in ``--help`` order;
- ``app``: ``main`` (the ``corral`` entry point; ``python -m supervisor.cli``).
"""

from supervisor.cli.app import main
from supervisor.cli.parser import build_parser

__all__ = ["build_parser", "main"]
