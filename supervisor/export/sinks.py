"""Where checkpoints go: the ``ExportSink`` protocol, a directory sink and an HTTP sink.

Invariants:
- A sink either takes the whole document or raises ``SinkError`` (kind, message,
  retryable); it never raises anything else except ``CancelledError``. The engine turns
  a ``SinkError`` into a warning event and a record and keeps the run going
  (``export_to_sinks`` collects the failures instead of raising).
- ``DirectorySink`` writes atomically: a temporary file in the same directory, fsync,
  rename, fsync of the directory. A reader sees the old set of files or the new one,
  never a partial file. File name: ``<session>-t<turn>-<digest prefix>.json``.
- Every document is bounded (``max_bytes``) and every HTTP call has a deadline.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import secrets
import ssl
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from supervisor.export.canonical import DIGEST_PREFIX, canonical_bytes
from supervisor.export.errors import SinkError

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 64 << 20
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


@runtime_checkable
class ExportSink(Protocol):
    async def export(self, doc: dict[str, Any]) -> None: ...


def _encode(doc: Mapping[str, Any], sink: str, max_bytes: int) -> bytes:
    try:
        data = canonical_bytes(doc)
    except (TypeError, ValueError) as exc:
        raise SinkError("bad_document", f"checkpoint is not JSON: {exc}", retryable=False,
                        sink=sink) from exc
    if len(data) > max_bytes:
        raise SinkError("too_large", f"checkpoint is {len(data)} bytes, above {max_bytes}",
                        retryable=False, sink=sink)
    return data


def file_name(doc: Mapping[str, Any]) -> str:
    """``<session>-t<turn>-<first 12 hex of digest>.json`` (session id made path-safe)."""
    d = doc.get("descriptor", {})
    # Path-safe, and never hidden (temporary files are the dot-files).
    session = _UNSAFE.sub("_", str(d.get("session_id", "session")))[:100].lstrip(".")
    session = session or "session"
    digest = str(d.get("digest", ""))
    if digest.startswith(DIGEST_PREFIX):
        digest = digest[len(DIGEST_PREFIX):]
    turn = d.get("turn", 0)
    turn_text = f"{turn:04d}" if isinstance(turn, int) else "x"
    return f"{session}-t{turn_text}-{_UNSAFE.sub('_', digest[:12])}.json"


class DirectorySink:
    """Writes each checkpoint as one file in ``path`` (created if missing). The default.

    Bounded: after each write only the newest ``keep_per_session`` files of that
    session are kept (a checkpoint supersedes the ones before it)."""

    def __init__(self, path: Path | str, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 keep_per_session: int = 5) -> None:
        if keep_per_session < 1:
            raise ValueError("keep_per_session must be at least 1")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.keep_per_session = keep_per_session

    def __repr__(self) -> str:
        return f"DirectorySink({str(self.path)!r})"

    async def export(self, doc: dict[str, Any]) -> None:
        data = _encode(doc, repr(self), self.max_bytes)
        name = file_name(doc)
        try:
            await asyncio.to_thread(self._write, name, data)
        except OSError as exc:
            raise SinkError("io_error", f"cannot write {self.path / name}: {exc.strerror}",
                            retryable=True, sink=repr(self)) from exc

    def _write(self, name: str, data: bytes) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        tmp = self.path / f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                view = memoryview(data)
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._prune(name)
        dir_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def _prune(self, written: str) -> None:
        """Drop this session's older checkpoints beyond ``keep_per_session``."""
        session = written.rsplit("-t", 1)[0]
        mine: list[tuple[int, Path]] = []
        for p in self.path.glob(f"{session}-t*.json"):
            if p.name.rsplit("-t", 1)[0] != session:
                continue  # another session whose id merely starts the same way
            try:
                mine.append((p.stat().st_mtime_ns, p))
            except FileNotFoundError:
                continue
        mine.sort()
        for _, old in mine[:-self.keep_per_session]:
            if old.name != written:
                old.unlink(missing_ok=True)


class HttpSink:
    """POSTs each checkpoint as JSON to ``url``; any non-2xx answer is a failure."""

    def __init__(self, url: str, timeout_s: float = 10.0, *,
                 headers: Mapping[str, str] | None = None,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.headers = dict(headers or {})
        self.max_bytes = max_bytes

    def __repr__(self) -> str:
        return f"HttpSink({self.url!r})"

    async def export(self, doc: dict[str, Any]) -> None:
        data = _encode(doc, repr(self), self.max_bytes)
        headers = {"content-type": "application/json", **self.headers}
        # httpx is imported here, not at module level: only a farm with an HTTP
        # sink needs it, and it is a fifth of the supervisor's start-up imports.
        import httpx

        try:
            async with asyncio.timeout(self.timeout_s):
                async with httpx.AsyncClient(timeout=self.timeout_s,
                                             verify=_tls_context()) as client:
                    response = await client.post(self.url, content=data, headers=headers)
        except TimeoutError as exc:
            raise SinkError("timeout", f"{self.url}: no answer within {self.timeout_s}s",
                            retryable=True, sink=repr(self)) from exc
        except httpx.TimeoutException as exc:
            raise SinkError("timeout", f"{self.url}: {type(exc).__name__}", retryable=True,
                            sink=repr(self)) from exc
        except httpx.HTTPError as exc:
            raise SinkError("connect_error", f"{self.url}: {type(exc).__name__}: {exc}",
                            retryable=True, sink=repr(self)) from exc
        if not 200 <= response.status_code < 300:
            raise SinkError(
                "http_status", f"{self.url} answered {response.status_code}",
                retryable=response.status_code >= 500 or response.status_code == 429,
                sink=repr(self),
            )


async def export_to_sinks(doc: dict[str, Any], sinks: Sequence[ExportSink]) -> list[SinkError]:
    """Give ``doc`` to every sink in turn; return the failures instead of raising them."""
    failures: list[SinkError] = []
    for sink in sinks:
        try:
            await sink.export(doc)
        except SinkError as exc:
            log.warning("checkpoint export to %r failed: %s", sink, exc)
            failures.append(exc)
        except Exception as exc:  # a host-provided sink broke its contract: still data
            log.warning("checkpoint export to %r failed unexpectedly: %r", sink, exc)
            failures.append(SinkError("sink_error", f"{type(exc).__name__}: {exc}",
                                      retryable=False, sink=repr(sink)))
    return failures


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One verifying TLS context for every HTTP sink: building one loads the CA
    bundle (about 30 ms of CPU, 0.4 s on a loaded machine), so it is not done per
    export."""
    import httpx

    return httpx.create_ssl_context()
