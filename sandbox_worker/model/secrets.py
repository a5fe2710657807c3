"""API keys: where they come from, and keeping them out of every log line.

Keys come only from the worker's own environment, or from a credentials file
named on its command line (``KEY=VALUE`` lines). A route names the variable
(``credential_env``); without one the defaults are ``CORRAL_API_KEY``, then
``OPENAI_API_KEY`` (OpenAI routes) or ``ANTHROPIC_API_KEY`` (Anthropic). A
route to a loopback server, or a scripted route, may go without a key.

Invariants:
- A key value is never returned to the supervisor, never put in a failure
  message or an exception text, and never written to ``os.environ`` (so
  nothing of the model service leaks into a tool sandbox's environment).
  A provider's output that holds one (a proxy echoing its headers, a hostile
  endpoint) has it replaced by ``[REDACTED]`` in the call's result and in each
  PARTIAL (``redact_value``), so it reaches no transcript, checkpoint, export,
  event or tool argument; a key split across two PARTIALs is caught in the
  result only.
- Once ``install_log_redaction`` ran, every log record created in the
  process has known key values replaced by ``[REDACTED]`` in its message and
  its formatted traceback, whatever logger or handler it goes to; keys
  resolved later are added to the known set before they are used.
- hpack and h2, which log raw headers at DEBUG, are capped at INFO.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

from sandbox_worker.api import GENERIC_ENV, PROVIDER_ENV, ModelRoute
from sandbox_worker.model.errors import AuthError

REDACTED: Final = "[REDACTED]"
# Environment names whose values are treated as secrets for redaction.
SECRET_NAME_HINTS: Final = ("API_KEY", "_TOKEN", "SECRET", "PASSWORD")
MIN_SECRET_CHARS: Final = 8
HEADER_LOGGERS: Final = ("hpack", "h2")

_known: set[str] = set()
_installed = False


def add_secret(value: str) -> None:
    """Add a value to the redaction set (values shorter than 8 chars are ignored)."""
    if len(value) >= MIN_SECRET_CHARS:
        _known.add(value)


def redact(text: str) -> str:
    for secret in _known:
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


def redact_value(value: Any) -> Any:
    """``value`` (JSON-like: dicts, lists, strings) with every known key value
    in its strings replaced by ``REDACTED``; the same object when none holds one."""
    if not _known:
        return value
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        out = {k: redact_value(v) for k, v in value.items()}
        return value if all(out[k] is value[k] for k in value) else out
    if isinstance(value, list):
        items = [redact_value(v) for v in value]
        return value if all(a is b for a, b in zip(items, value, strict=True)) else items
    return value


def _redact_record(record: logging.LogRecord) -> None:
    try:
        message = record.getMessage()
    except Exception:  # a bad format string: the handler reports it; nothing to redact
        return
    cleaned = redact(message)
    if cleaned != message:
        record.msg, record.args = cleaned, None
    if record.exc_info and not record.exc_text:
        text = logging.Formatter().formatException(record.exc_info)
        cleaned = redact(text)
        if cleaned != text:
            record.exc_text = cleaned


def install_log_redaction(environ: Mapping[str, str] | None = None) -> None:
    """Redact known secrets from every log record of this process (idempotent)."""
    global _installed
    env = os.environ if environ is None else environ
    for name, value in env.items():
        if any(h in name.upper() for h in SECRET_NAME_HINTS):
            add_secret(value)
    for name in HEADER_LOGGERS:
        logger = logging.getLogger(name)
        if logger.getEffectiveLevel() < logging.INFO:
            logger.setLevel(logging.INFO)
    if _installed:
        return
    _installed = True
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        if _known:
            _redact_record(record)
        return record

    logging.setLogRecordFactory(factory)


def load_credentials_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines; blank lines and ``#`` comments are skipped."""
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        values[key.strip()] = value.strip().strip("'\"")
    return values


def is_local(base_url: str) -> bool:
    host = urlsplit(base_url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Credentials:
    """Resolves a route's key from the environment or the credentials file."""

    def __init__(self, environ: Mapping[str, str], file_values: Mapping[str, str]) -> None:
        self._environ = environ
        self._file = dict(file_values)
        for value in self._file.values():
            add_secret(value)

    def names_for(self, route: ModelRoute) -> list[str]:
        if route.get("credential_env"):
            return [route["credential_env"]]
        return [GENERIC_ENV, PROVIDER_ENV[route["provider"]]]

    def key_for(self, route: ModelRoute) -> str | None:
        names = self.names_for(route)
        for name in names:
            value = self._file.get(name) or self._environ.get(name)
            if value:
                add_secret(value)
                return value
        if route.get("script") or is_local(route["base_url"]):
            return None
        raise AuthError(f"no API key for route {route['name']!r}: set "
                        f"{' or '.join(names)} in the worker's environment")

    def info(self) -> dict[str, Any]:
        """Which credential names are available (names only, never values)."""
        names = {GENERIC_ENV, *PROVIDER_ENV.values()}
        return {"credentials_available": sorted(
            n for n in names if self._file.get(n) or self._environ.get(n))}
