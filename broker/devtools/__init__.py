"""The broker's dev tooling: benchmarks and the echo demo. Never imported by a
production process (``python -m broker``, the workers, the supervisor), pinned
by tests/architecture/test_production_imports.py.

- ``bench``: ``scripts/bench broker`` (``python -m broker.devtools.bench``);
  ``--curve`` runs ``bench_curve`` (what CURVE costs);
- ``bench_scaleout``: does the farm scale out across hosts;
- ``demo``: the echo demo, a worker SIGKILLed in the middle of requests;
- ``children``: what every package's benchmarks share: their child processes
  (started, awaited ready under a deadline, stopped by pid) and their table.
"""
