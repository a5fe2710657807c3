"""Errors of portable checkpoint export.

Exception tree::

    ExportError                 every export failure (a ``broker.protocol.Failed``)
    ├── CheckpointInvalid       verify() found problems (.problems: list[str])
    ├── BindingMismatch         import refused: the capability binding differs
    └── SinkError               a sink could not take the checkpoint (.kind, .retryable);
                                the engine turns it into a warning event and a record
                                and keeps running

Foreign errors (httpx, OSError) become ``SinkError`` at the sink that met them.
"""

from __future__ import annotations

from broker.protocol import Failed


class ExportError(Failed):
    kind: str = "export_error"
    retryable: bool = False


class CheckpointInvalid(ExportError):
    kind = "checkpoint_invalid"

    def __init__(self, problems: list[str]) -> None:
        super().__init__("invalid checkpoint: " + "; ".join(problems))
        self.problems = problems


class BindingMismatch(ExportError):
    kind = "binding_mismatch"


class SinkError(ExportError):
    def __init__(self, kind: str, message: str, *, retryable: bool, sink: str) -> None:
        super().__init__(message, kind=kind, retryable=retryable)
        self.sink = sink
