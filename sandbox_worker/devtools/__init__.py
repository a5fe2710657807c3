"""The sandbox worker's dev tooling: benchmarks. Never imported by a production
process (``python -m sandbox_worker``), pinned by
tests/architecture/test_production_imports.py.

- ``tools_bench``: ``scripts/bench tools``, sandboxed tool calls;
- ``model_bench``: ``scripts/bench model``, the model call path;
- ``bench_minimal``: the sessions benchmark's minimal loop (provider and
  sandboxed tool, no broker, no store), run as a child process by
  ``supervisor.devtools.sessions_bench``.
"""
