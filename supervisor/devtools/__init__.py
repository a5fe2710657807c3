"""The supervisor's dev tooling: benchmarks and the demo. Never imported by a
production process (``python -m supervisor``, the farm's root, the ``corral``
parser), pinned by tests/architecture/test_production_imports.py; the chaos
harness (``supervisor/chaos/``) is held to the same rule.

- ``sessions_bench``: ``scripts/bench sessions``, the full session path
  against a minimal loop (``sandbox_worker.devtools.bench_minimal``);
- ``store_bench``: ``scripts/bench store``, the SQLite store;
- ``demo``: ``scripts/demo``, a farm doing real work while processes are
  killed (it drives the chaos harness).
"""
