"""Typed failures of model calls, and the one boundary that produces them.

Every failure of a model call is a ``ModelError`` carrying a failure kind from
``sandbox_worker.api`` (``MODEL_FAILURE_*``), a message safe to send across
processes, and whether a retry may succeed. httpx exceptions and HTTP error
statuses are translated here and nowhere else.

Exception tree::

    ModelError(kind, message, retryable)   a ``broker.protocol.Failed``
    ├── AuthError           auth          401/403, missing credential   not retryable
    ├── BadRequestError     bad_request   400/404/413/422, bad input    not retryable
    ├── RateLimitedError    rate_limited  429 (carries retry_after_s)   retryable
    ├── ServerError         server_error  5xx, 408/409/529               retryable
    ├── ConnectError        connect_error connection refused/reset/DNS  retryable
    ├── ModelTimeout        timeout       connect/read/write/pool/budget retryable
    └── StreamError         stream_error  malformed or truncated stream retryable

Invariants:
- A message never holds an API key, a full response body or a traceback: it
  is built from the status, the provider's short error message (cut to
  ``MAX_PROVIDER_MESSAGE_CHARS``) and a description of the transport failure in
  words (never an exception's class name).
- ``partial_relayed`` is set by the caller when deltas of the failed attempt
  already reached the client, so the client can discard them.
"""

from __future__ import annotations

import json
import math
from typing import Any, Final

import httpx

from broker.protocol import Failed
from sandbox_worker.api import (
    MODEL_FAILURE_AUTH,
    MODEL_FAILURE_BAD_REQUEST,
    MODEL_FAILURE_CONNECT,
    MODEL_FAILURE_RATE_LIMITED,
    MODEL_FAILURE_SERVER,
    MODEL_FAILURE_STREAM,
    MODEL_FAILURE_TIMEOUT,
)

MAX_PROVIDER_MESSAGE_CHARS: Final = 300
MAX_RETRY_AFTER_S: Final = 600.0


class ModelError(Failed):
    """A failed model call, as data: kind, safe message, retryability."""

    kind: str = "internal"
    retryable: bool = False

    def __init__(self, message: str, *, retry_after_s: float | None = None,
                 status: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.status = status
        self.partial_relayed = False
        self.attempts = 1


class AuthError(ModelError):
    kind = MODEL_FAILURE_AUTH


class BadRequestError(ModelError):
    kind = MODEL_FAILURE_BAD_REQUEST


class RateLimitedError(ModelError):
    kind = MODEL_FAILURE_RATE_LIMITED
    retryable = True


class ServerError(ModelError):
    kind = MODEL_FAILURE_SERVER
    retryable = True


class ConnectError(ModelError):
    kind = MODEL_FAILURE_CONNECT
    retryable = True


class ModelTimeout(ModelError):
    kind = MODEL_FAILURE_TIMEOUT
    retryable = True


class StreamError(ModelError):
    kind = MODEL_FAILURE_STREAM
    retryable = True


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds only; dates are ignored)."""
    if not value:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    if not math.isfinite(seconds) or seconds < 0:
        return None
    return min(seconds, MAX_RETRY_AFTER_S)


def provider_message(body: bytes) -> str:
    """The provider's short error message from an error body, never the body itself.

    OpenAI: ``{"error": {"message": ...}}``; Anthropic:
    ``{"type": "error", "error": {"type": ..., "message": ...}}``.
    """
    try:
        data: Any = json.loads(body[:65536])
    except ValueError:
        return ""
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        msg = err.get("message")
        if isinstance(msg, str):
            return msg[:MAX_PROVIDER_MESSAGE_CHARS]
    return ""


def from_status(status: int, body: bytes, headers: httpx.Headers, what: str) -> ModelError:
    """Translate an HTTP error status into a typed failure."""
    detail = provider_message(body)
    message = f"{what}: HTTP {status}" + (f": {detail}" if detail else "")
    if status in (401, 403):
        return AuthError(message, status=status)
    if status == 429:
        retry_after = parse_retry_after(headers.get("retry-after"))
        if retry_after is None:
            # OpenAI also sends retry-after-ms.
            ms = parse_retry_after(headers.get("retry-after-ms"))
            retry_after = None if ms is None else ms / 1000.0
        return RateLimitedError(message, retry_after_s=retry_after, status=status)
    if status in (408,):
        return ModelTimeout(message, status=status)
    if status >= 500 or status in (409, 529):
        return ServerError(message, retry_after_s=parse_retry_after(headers.get("retry-after")),
                           status=status)
    return BadRequestError(message, status=status)


def _url_of(exc: httpx.HTTPError, url: httpx.URL | None) -> str:
    """The request's URL without query or credentials (they may hold a key)."""
    if url is None:
        try:
            url = exc.request.url
        except RuntimeError:
            return "the route's base_url"
    port = f":{url.port}" if url.port else ""
    return f"{url.scheme}://{url.host}{port}{url.path}"


def from_httpx(exc: httpx.HTTPError, what: str, *, streaming: bool,
               url: httpx.URL | None = None) -> ModelError:
    """Translate an httpx exception; ``streaming`` means the response had begun.
    A connection error names the URL it could not reach (``url``, else the
    exception's request)."""
    if isinstance(exc, httpx.TimeoutException):
        return ModelTimeout(f"{what}: {_describe(exc)}")
    if isinstance(exc, httpx.ConnectError):
        return ConnectError(f"{what}: cannot connect to {_url_of(exc, url)} "
                            f"({str(exc)[:200] or 'refused'}); check the route's base_url "
                            "and that the server is up")
    if streaming or isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError):
        # The peer cut the connection mid-answer, or the framing broke.
        return StreamError(f"{what}: stream broken ({_describe(exc)})")
    if isinstance(exc, httpx.TransportError):
        return ConnectError(f"{what}: {_describe(exc)}")
    return BadRequestError(f"{what}: {_describe(exc)}")


# What an httpx failure was, in words: a message that reaches clients never
# carries an exception's class name.
_DESCRIPTIONS: Final = (
    (httpx.ConnectTimeout, "timed out connecting"),
    (httpx.ReadTimeout, "timed out waiting for data"),
    (httpx.WriteTimeout, "timed out sending the request"),
    (httpx.PoolTimeout, "timed out waiting for a free connection"),
    (httpx.TimeoutException, "timed out"),
    (httpx.RemoteProtocolError, "the server broke the HTTP protocol or closed the connection"),
    (httpx.ReadError, "reading the response failed"),
    (httpx.WriteError, "sending the request failed"),
    (httpx.TransportError, "a transport error"),
)


def _describe(exc: httpx.HTTPError) -> str:
    return next((text for kind, text in _DESCRIPTIONS if isinstance(exc, kind)),
                "the request failed")
