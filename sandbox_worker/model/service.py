"""The ``model`` service: the broker handler for model calls.

``ModelService.handle`` decodes a ``ModelCallRequest``, makes the call over
the worker's pooled httpx transports (``pool``), relays deltas as PARTIALs
(``relay``) and replies with one ``ModelCallResult``. Failures leave as
``HandlerError(kind, message, retryable, body)`` (a broker FAILURE), with
``body`` a packed map ``{"discard_partial", "attempts", "status"}``.

Retries: a retryable failure (rate limit, 5xx, connection, timeout, broken
stream) is retried here with jittered exponential backoff, honouring
Retry-After, at most ``max_retries`` times, and only while the request's
remaining budget (``ctx.budget_s()``) can hold the wait plus a minimal
attempt. Each retry is announced by a ``retry`` PARTIAL whose
``discard_partial`` says whether deltas of the failed attempt were relayed.

Invariants:
- Every attempt runs under ``asyncio.timeout`` of the remaining budget minus
  ``reply_margin_s``, so the worker answers before the broker's deadline.
- A cancellation (broker CANCEL) propagates untouched; leaving the ``async
  with`` of the stream closes the HTTP connection.
- No API key enters a request, a PARTIAL, a reply, a failure or a log line.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx

from broker.errors import HandlerError
from broker.protocol import ProtocolError, pack, unpack
from broker.worker import RequestContext
from sandbox_worker.api import (
    MODEL_FAILURE_BAD_REQUEST,
    PROVIDERS,
    ModelCallRequest,
    ModelCallResult,
    ModelDelta,
)
from sandbox_worker.model import http
from sandbox_worker.model.errors import BadRequestError, ModelError, ModelTimeout
from sandbox_worker.model.pool import ClientShards
from sandbox_worker.model.relay import DeltaRelay
from sandbox_worker.model.secrets import (
    Credentials,
    install_log_redaction,
    load_credentials_file,
    redact,
    redact_value,
)
from sandbox_worker.model.streams import Decoded

log = logging.getLogger(__name__)

MAX_ITEMS: Final = 50_000
MAX_TOOLS: Final = 512
# A retry is only worth starting if this much budget is left after the wait.
MIN_ATTEMPT_S: Final = 0.25


@dataclass(frozen=True, slots=True)
class ModelServiceConfig:
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 120.0  # the longest silence tolerated inside a stream
    write_timeout_s: float = 30.0
    pool_timeout_s: float = 30.0
    max_retries: int = 4
    backoff_base_s: float = 0.5
    backoff_max_s: float = 8.0
    http2: bool = True
    max_connections: int = 100
    flush_interval_s: float = 0.005
    flush_max_chars: int = 16 * 1024
    reply_margin_s: float = 0.2
    max_response_bytes: int = 32 * 1024 * 1024
    credentials_file: Path | None = None
    trust_env: bool = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model service")
    d = ModelServiceConfig()
    g.add_argument("--model-connect-timeout-s", type=float, default=d.connect_timeout_s,
                   help="longest wait to connect to the provider")
    g.add_argument("--model-read-timeout-s", type=float, default=d.read_timeout_s,
                   help="longest silence tolerated while reading a reply")
    g.add_argument("--model-max-retries", type=int, default=d.max_retries,
                   help="retries of a provider request that failed retryably")
    g.add_argument("--model-backoff-base-s", type=float, default=d.backoff_base_s,
                   help="first backoff between retries (doubling, jittered)")
    g.add_argument("--model-backoff-max-s", type=float, default=d.backoff_max_s,
                   help="longest backoff between retries")
    g.add_argument("--model-no-http2", action="store_true", help="use HTTP/1.1 only")
    g.add_argument("--model-max-connections", type=int, default=d.max_connections,
                   help="HTTP connections to providers this worker keeps at most")
    g.add_argument("--model-flush-interval-s", type=float, default=d.flush_interval_s,
                   help="how long deltas may be coalesced before a PARTIAL is sent")
    g.add_argument("--model-credentials-file", type=Path, default=None,
                   help="KEY=VALUE file of API keys (instead of the environment)")


def config_from_args(ns: argparse.Namespace) -> ModelServiceConfig:
    return ModelServiceConfig(
        connect_timeout_s=ns.model_connect_timeout_s,
        read_timeout_s=ns.model_read_timeout_s,
        max_retries=ns.model_max_retries,
        backoff_base_s=ns.model_backoff_base_s,
        backoff_max_s=ns.model_backoff_max_s,
        http2=not ns.model_no_http2,
        max_connections=ns.model_max_connections,
        flush_interval_s=ns.model_flush_interval_s,
        credentials_file=ns.model_credentials_file,
    )


def parse_request(body: bytes) -> ModelCallRequest:
    """Decode and check a ``ModelCallRequest``; raise ``BadRequestError``."""
    try:
        req = unpack(body)
    except ProtocolError as exc:
        raise BadRequestError(f"model request: {exc}") from exc
    if not isinstance(req, dict):
        raise BadRequestError("model request must be a map")
    if req.get("op") not in ("respond", "compact"):
        raise BadRequestError("model request: op must be 'respond' or 'compact'")
    route = req.get("route")
    if not isinstance(route, dict):
        raise BadRequestError("model request: route must be a map")
    if route.get("provider") not in PROVIDERS:
        raise BadRequestError(f"model request: provider must be one of {', '.join(PROVIDERS)}")
    for key in ("name", "model", "base_url"):
        if not isinstance(route.get(key), str) or not route[key]:
            raise BadRequestError(f"model request: route.{key} must be a non-empty string")
    if not route["base_url"].startswith(("http://", "https://")):
        raise BadRequestError("model request: route.base_url must be an http(s) URL")
    items, tools = req.get("items"), req.get("tools")
    if not isinstance(items, list) or len(items) > MAX_ITEMS:
        raise BadRequestError(f"model request: items must be a list of at most {MAX_ITEMS}")
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS or not all(
            isinstance(t, dict) and isinstance(t.get("name"), str)
            and isinstance(t.get("parameters"), dict) for t in tools):
        raise BadRequestError("model request: tools must be a list of tool schemas")
    if not isinstance(req.get("stream"), bool) or not isinstance(req.get("session_id"), str):
        raise BadRequestError("model request: stream (bool) and session_id (str) are required")
    if not isinstance(req.get("instructions", ""), str):
        raise BadRequestError("model request: instructions must be a string")
    if req["op"] == "compact" and not (route.get("native_compaction") is True
                                       and route["provider"] == "openai-responses"):
        raise BadRequestError(f"route {route['name']!r} has no native compaction; "
                              "summarize with op 'respond'")
    return req  # type: ignore[return-value]


class ModelService:
    """One per worker process; holds the pooled HTTP client."""

    def __init__(self, config: ModelServiceConfig) -> None:
        self.config = config
        self._client: ClientShards | None = None
        self._creds = Credentials({}, {})
        self.calls = 0
        self.retries = 0

    async def start(self) -> None:
        cfg = self.config
        file_values = load_credentials_file(cfg.credentials_file) if cfg.credentials_file else {}
        self._creds = Credentials(os.environ, file_values)
        install_log_redaction()
        self._client = ClientShards(
            max_connections=cfg.max_connections,
            max_keepalive=min(32, cfg.max_connections), keepalive_expiry_s=30.0,
            http2=cfg.http2, trust_env=cfg.trust_env)

    def info(self) -> dict[str, Any]:
        return {"providers": list(PROVIDERS), "http2": self.config.http2,
                **self._creds.info()}

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    async def handle(self, ctx: RequestContext) -> bytes:
        try:
            req = parse_request(ctx.body)
        except BadRequestError as exc:
            raise HandlerError(MODEL_FAILURE_BAD_REQUEST, exc.message, retryable=False) from None
        try:
            result = await self.call(req, ctx)
        except ModelError as exc:
            message = redact(exc.message)
            if exc.partial_relayed:
                message += " (partial output was relayed; discard it)"
            body = pack({"discard_partial": exc.partial_relayed, "status": exc.status,
                         "attempts": exc.attempts})
            log.info("model call %s failed: %s %s", ctx.request_id, exc.kind, message)
            raise HandlerError(exc.kind, message, retryable=exc.retryable, body=body) from None
        return pack(result)

    def _timeout(self, req: ModelCallRequest) -> httpx.Timeout:
        route, cfg = req["route"], self.config
        return httpx.Timeout(connect=route.get("connect_timeout_s", cfg.connect_timeout_s),
                             read=route.get("read_timeout_s", cfg.read_timeout_s),
                             write=cfg.write_timeout_s, pool=cfg.pool_timeout_s)

    def _backoff_s(self, retry: int, error: ModelError) -> float:
        if error.retry_after_s is not None:
            return error.retry_after_s
        cap = min(self.config.backoff_max_s, self.config.backoff_base_s * 2.0**retry)
        return cap * (0.5 + random.random() / 2)  # jitter: half to full

    async def call(self, req: ModelCallRequest, ctx: RequestContext) -> ModelCallResult:
        client = self._client
        if client is None:
            raise RuntimeError("ModelService.start() was not awaited")
        route = req["route"]
        api_key = self._creds.key_for(route)
        max_retries = route.get("max_retries", self.config.max_retries)
        margin = self.config.reply_margin_s
        timeout = self._timeout(req)
        self.calls += 1
        attempt_no = 1
        while True:
            started = time.monotonic()
            relay = DeltaRelay(ctx.send_partial, flush_interval_s=self.config.flush_interval_s,
                               max_chars=self.config.flush_max_chars)
            error: ModelError
            try:
                budget_s = ctx.budget_s() - margin
                if budget_s <= 0:
                    raise ModelTimeout(f"{route['provider']} {route['model']}: "
                                       "the request's budget ran out")
                # The provider sees the overall attempt: the broker's attempt (the
                # supervisor re-issues a lost call with attempt + 1) plus ours.
                overall = attempt_no + max(ctx.attempt, 1) - 1
                async with asyncio.timeout(budget_s) as budget:
                    decoded = await self._attempt(client, req, api_key, overall, timeout, relay)
                items, stop, usage = decoded
                items = redact_value(items)  # a provider that echoes a key (secrets.py)
                log.info("model call %s: %s %s ok in %.3fs (attempt %d, %d partials)",
                         ctx.request_id, route["provider"], route["model"],
                         time.monotonic() - started, attempt_no, relay.relayed)
                return ModelCallResult(items=items, stop_reason=stop, usage=usage,
                                       provider=route["provider"], model=route["model"],
                                       retries=attempt_no - 1)
            except TimeoutError:
                if not budget.expired():
                    raise
                error = ModelTimeout(f"{route['provider']} {route['model']}: "
                                     "the request's budget ran out")
            except ModelError as exc:
                error = exc
            error.partial_relayed = relay.relayed > 0
            error.attempts = attempt_no
            if not error.retryable or attempt_no > max_retries:
                raise error
            delay_s = self._backoff_s(attempt_no - 1, error)
            if delay_s + MIN_ATTEMPT_S > ctx.budget_s() - margin:
                error.message += f"; gave up after {attempt_no} attempt(s): budget exhausted"
                raise error
            log.info("model call %s: attempt %d failed (%s: %s), retrying in %.2fs",
                     ctx.request_id, attempt_no, error.kind, error.message, delay_s)
            attempt_no += 1
            self.retries += 1
            retry: ModelDelta = {"type": "retry", "attempt": attempt_no, "kind": error.kind,
                                 "message": redact(error.message), "delay_s": delay_s,
                                 "discard_partial": error.partial_relayed}
            await ctx.send_partial(pack(retry))
            await asyncio.sleep(delay_s)

    async def _attempt(self, shards: ClientShards, req: ModelCallRequest,
                       api_key: str | None, attempt_no: int, http_timeout: httpx.Timeout,
                       relay: DeltaRelay) -> Decoded:
        # The relay's timer (if it started one) is stopped on every exit; its own
        # failure is raised only if the attempt itself succeeded.
        try:
            decoded = await http.attempt(
                shards, req, api_key=api_key, attempt_no=attempt_no,
                http_timeout=http_timeout, on_deltas=relay.push,
                max_response_bytes=self.config.max_response_bytes)
            await relay.flush()
        except BaseException:
            await relay.aclose(check=False)
            raise
        await relay.aclose()
        return decoded
