"""Telemetry: Prometheus metrics, OpenTelemetry traces and the farm web view.

Everything here observes the engine from its boundaries and never steers it:
- ``hub.Telemetry`` is the one object the supervisor hands to the engine: the
  manager calls ``committed(step, seconds)`` after each store commit (the
  durable events, in commit order) and ``calls.stream_call`` asks it for a
  ``CallWatch`` per request (timings, outcome, the trace context to send).
- ``metrics`` turns those into Prometheus series, plus the farm-wide figures
  (broker, workers, restarts) read at scrape time from the status the
  supervisor already queries.
- ``tracing`` builds OpenTelemetry spans (turn, step, tool, approval,
  compaction) and the ``traceparent`` a request carries to the worker.
- ``web`` serves the read-only live page.

Invariants: telemetry that is off imports nothing of prometheus_client or
opentelemetry; an observer's failure is logged and never reaches a turn;
labels are bounded (``labels.Bounded``), never a session or call id.
"""
