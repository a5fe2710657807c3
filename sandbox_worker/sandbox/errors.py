"""Errors of the sandbox and tool layers (one tree for both).

Foreign errors (OSError from syscalls, subprocess failures, libseccomp) are
translated into these at the module that calls them. ``ToolError`` and its
subclasses are *results the model reads* (``ToolCallResult.is_error``) and
carry the ``error_kind`` string; ``SandboxError`` subclasses are operator
problems (a tier below the minimum, a missing user) and are reported with a
hint on how to fix them.

Exception tree::

    CorralSandboxError                 base of everything raised here
    ├── SandboxError                   the sandbox itself cannot serve
    │   ├── TierUnavailable            detected tier is below tier_min (has a fix hint)
    │   ├── SandboxSetupError          sandbox user, seccomp or cgroup set-up failed
    │   └── WorkspaceUnusable          the workspace cannot be given to the sandbox uid
    └── ToolError(kind, message)       a tool call failed; becomes a ToolCallResult
        ├── BadArguments               "bad_arguments": wrong/missing arguments
        ├── UnknownTool                "unknown_tool"
        ├── OutsideWorkspace           "outside_workspace": .., absolute, symlink escape
        ├── FileProblem                "not_found", "is_a_directory", "too_large",
        │                              "hardlinked", "permission_denied", "not_utf8", ...
        ├── EditMismatch               "old_not_found" / "old_ambiguous"
        └── UidPoolExhausted           "uid_pool_exhausted": no free per-call uid
"""

from __future__ import annotations


class CorralSandboxError(Exception):
    """Base of the sandbox and tool errors."""


class SandboxError(CorralSandboxError):
    """The sandbox cannot serve; an operator has to act."""

    def __init__(self, message: str, *, hint: str = "") -> None:
        super().__init__(f"{message}. {hint}".strip() if hint else message)
        self.hint = hint


class TierUnavailable(SandboxError):
    """The best working tier is below the configured minimum."""


class SandboxSetupError(SandboxError):
    """A layer could not be prepared (user, seccomp filter, cgroup)."""


class WorkspaceUnusable(SandboxError):
    """The workspace cannot be reached or granted to the sandbox uid."""


class ToolError(CorralSandboxError):
    """A tool call failed in a way the model should read (not a crash)."""

    kind = "tool_error"

    def __init__(self, message: str, *, kind: str | None = None) -> None:
        super().__init__(message)
        if kind is not None:
            self.kind = kind


class BadArguments(ToolError):
    kind = "bad_arguments"


class UnknownTool(ToolError):
    kind = "unknown_tool"


class OutsideWorkspace(ToolError):
    kind = "outside_workspace"


class FileProblem(ToolError):
    kind = "file_error"


class EditMismatch(ToolError):
    kind = "old_not_found"


class UidPoolExhausted(ToolError):
    """Every per-call uid of the range is in use (or held by leftover processes)."""

    kind = "uid_pool_exhausted"
