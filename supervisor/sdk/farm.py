"""``EmbeddedFarm``: a whole farm (scripted providers, broker, sandbox workers,
supervisor; the same supervision tree ``corral up`` runs) started by this
program for the duration of an ``async with`` block, then stopped.

With no ``home`` it makes a temporary home (``corral-sdk-*`` in the system's
temporary directory) and removes it afterwards; with a ``home`` it uses that
directory and leaves it (the sessions stay in its store, so a later farm on
the same home continues them). ``config`` is the ``corral.toml`` text to
write; ``script`` (a scripted provider's script, a mapping or a file) writes
a ``corral.toml`` whose default route ``scripted`` is that provider
(``sandbox_worker/fakellm``; docs/models.md, "Script format").

Invariants:
- Leaving the block stops every child in reverse start order and reaps it,
  also when the block raises or is cancelled; ``farm.json`` says
  ``"temporary": true`` while the farm lives, so ``corral`` commands reach it.
- A start-up failure raises ``FarmError`` (the child's own error line) from
  ``__aenter__``, with everything already started stopped.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from supervisor.farm.root import Farm
from supervisor.farm.tree import FarmError
from supervisor.sdk.corral import Corral

__all__ = ["EmbeddedFarm", "FarmError"]

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _check_arguments(home: str | Path | None, workers: int, approval: str,
                     log_level: str) -> None:
    """``ValueError`` at construction for an argument no farm could start with (a
    negative ``workers`` started a farm without workers; a ``home`` that is a file
    raised ``FileExistsError`` from the start)."""
    if isinstance(workers, bool) or not isinstance(workers, int) or not 0 <= workers <= 256:
        raise ValueError(f"workers must be a whole number from 0 (remote workers only) to "
                         f"256, got {workers!r}")
    if approval not in ("ask", "allow", "deny"):
        raise ValueError(f"approval must be 'ask', 'allow' or 'deny', got {approval!r}")
    if str(log_level).upper() not in _LOG_LEVELS:
        raise ValueError(f"log_level must be one of {', '.join(_LOG_LEVELS)}, got "
                         f"{log_level!r}")
    if home is not None:
        path = Path(home)
        for above in (path, *path.parents):
            if above.exists():
                if not above.is_dir():
                    raise ValueError(f"home {path} is not a directory ({above} is a file); "
                                     "give a directory (it is made when missing)")
                break


def scripted_config(*, approval: str = "ask") -> str:
    """The ``corral.toml`` of a farm whose default route is ``script.json`` in its home."""
    return (f'[session]\ndefault_route = "scripted"\napproval = "{approval}"\n'
            '[routes.scripted]\nscript = "script.json"\nread_timeout_s = 5.0\n')


class EmbeddedFarm:
    """A farm for the duration of ``async with EmbeddedFarm(...) as farm``."""

    def __init__(self, home: str | Path | None = None, *, workers: int = 1,
                 config: str | None = None,
                 script: Mapping[str, Any] | str | Path | None = None,
                 approval: str = "ask", log_level: str = "WARNING") -> None:
        _check_arguments(home, workers, approval, log_level)
        self._given_home = Path(home) if home is not None else None
        self.workers = workers
        self.config = config
        self.script = script
        self.approval = approval
        self.log_level = log_level
        self.home: Path = self._given_home or Path("/nonexistent")
        self._farm: Farm | None = None
        self._stack: contextlib.AsyncExitStack | None = None

    @property
    def endpoint(self) -> str:
        """The supervisor's client endpoint (``ipc://``)."""
        if self._farm is None:
            raise RuntimeError("the farm is not running; use 'async with EmbeddedFarm()'")
        return self._farm.paths.supervisor_endpoint

    def pids(self) -> dict[str, int]:
        """The pid of every running child, by name (``broker``, ``worker-1``,
        ``supervisor``, ``fakellm-scripted``)."""
        if self._farm is None:
            return {}
        return {name: child.pid for name, child in self._farm.tree.children.items()
                if child.pid is not None}

    def connect(self, **kwargs: Any) -> Corral:
        """A ``Corral`` connection to this farm (``async with farm.connect() as c``)."""
        return Corral(self.endpoint, **kwargs)

    def _prepare(self) -> None:
        if self._given_home is None:
            self.home = Path(tempfile.mkdtemp(prefix="corral-sdk-"))
        else:
            self.home = self._given_home.resolve()
            self.home.mkdir(parents=True, exist_ok=True)
        if self.script is not None:
            if isinstance(self.script, Mapping):
                text = json.dumps(dict(self.script))
            else:
                text = Path(self.script).read_text()
            (self.home / "script.json").write_text(text)
        if self.config is not None:
            (self.home / "corral.toml").write_text(self.config)
        elif self.script is not None:
            (self.home / "corral.toml").write_text(scripted_config(approval=self.approval))

    async def __aenter__(self) -> EmbeddedFarm:
        self._prepare()
        async with contextlib.AsyncExitStack() as stack:
            if self._given_home is None:
                stack.callback(shutil.rmtree, self.home, True)
            farm = Farm(self.home, workers=self.workers, log_level=self.log_level,
                        temporary=True)
            await stack.enter_async_context(farm.started())
            self._farm = farm
            self._stack = stack.pop_all()
        return self

    async def __aexit__(self, *exc: object) -> None:
        stack, self._stack = self._stack, None
        try:
            if stack is not None:
                await stack.__aexit__(None, None, None)
        finally:
            self._farm = None
