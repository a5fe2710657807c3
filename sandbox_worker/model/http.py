"""One HTTP attempt of a model call over the worker's pooled httpx transports.

Builds the URL, headers and body for the route's provider, sends it, and
decodes the reply (streamed SSE or JSON) into neutral deltas and a result.
Every httpx exception and error status is translated here (``errors``).

URLs (``base_url`` without a trailing slash):

- openai-responses: ``{base_url}/responses``; compaction ``{base_url}/responses/compact``
- openai-chat: ``{base_url}/chat/completions``
- anthropic: ``{base_url}/v1/messages``; a ``base_url`` that already ends in
  ``/v1`` is accepted and not doubled.

Invariants:
- Connect, read, write and pool timeouts are always set (httpx.Timeout).
- Bytes read from a provider are bounded: error bodies by
  ``MAX_ERROR_BODY_BYTES``, JSON replies by ``max_response_bytes``, each SSE
  event by the parser's limit.
- The first delta of a stream is relayed before the rest of its read is
  parsed (``read_stream``).
- The stream is closed when this coroutine exits for any reason, including
  cancellation (``open_stream``), so a CANCEL closes the HTTP connection at once.
- The API key is placed in one header and nowhere else.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any, Final

import httpx

from sandbox_worker.api import ModelCallRequest, ModelDelta
from sandbox_worker.model import items as wire
from sandbox_worker.model.errors import (
    BadRequestError,
    ModelError,
    StreamError,
    from_httpx,
    from_status,
)
from sandbox_worker.model.pool import ClientShards
from sandbox_worker.model.sse import SSEError, SSEParser
from sandbox_worker.model.streams import Decoded, decoder_for, responses_output_items
from sandbox_worker.model.streams import responses_usage as _responses_usage

ANTHROPIC_VERSION: Final = "2023-06-01"
ATTEMPT_HEADER: Final = "x-corral-attempt"
MAX_ERROR_BODY_BYTES: Final = 64 * 1024
USER_AGENT: Final = f"corral-worker (httpx/{httpx.__version__})"

OnDeltas = Callable[[list[ModelDelta]], Awaitable[None]]


def url_for(req: ModelCallRequest) -> str:
    route = req["route"]
    base = route["base_url"].rstrip("/")
    provider = route["provider"]
    if req["op"] == "compact":
        return f"{base}/responses/compact"
    if provider == "openai-responses":
        return f"{base}/responses"
    if provider == "openai-chat":
        return f"{base}/chat/completions"
    base = base.removesuffix("/v1")
    return f"{base}/v1/messages"


def headers_for(req: ModelCallRequest, api_key: str | None, attempt: int,
                stream: bool) -> dict[str, str]:
    headers = {"content-type": "application/json",
               "accept": "text/event-stream" if stream else "application/json",
               ATTEMPT_HEADER: str(attempt)}
    if req["route"]["provider"] == "anthropic":
        headers["anthropic-version"] = ANTHROPIC_VERSION
        if api_key:
            headers["x-api-key"] = api_key
    elif api_key:
        headers["authorization"] = f"Bearer {api_key}"
    return headers


def body_for(req: ModelCallRequest, stream: bool) -> dict[str, Any]:
    provider = req["route"]["provider"]
    if req["op"] == "compact":
        return wire.compact_body(req)
    if provider == "openai-responses":
        return wire.responses_body(req, stream=stream)
    if provider == "openai-chat":
        return wire.chat_body(req, stream=stream)
    return wire.anthropic_body(req, stream=stream)


def build_request(req: ModelCallRequest, *, api_key: str | None, attempt_no: int,
                  stream: bool, http_timeout: httpx.Timeout) -> httpx.Request:
    """The HTTP request of one attempt, its timeouts set as ``AsyncClient`` sets them."""
    content = json.dumps(body_for(req, stream), separators=(",", ":")).encode()
    headers = headers_for(req, api_key, attempt_no, stream)
    headers["user-agent"] = USER_AGENT
    return httpx.Request("POST", url_for(req), content=content, headers=headers,
                         extensions={"timeout": http_timeout.as_dict()})


@contextlib.asynccontextmanager
async def open_stream(transport: httpx.AsyncBaseTransport, request: httpx.Request
                      ) -> AsyncIterator[httpx.Response]:
    """Send ``request`` and yield its response, body unread; the response is
    closed on every exit, so leaving early (a cancel) closes the connection."""
    response = await transport.handle_async_request(request)
    response.request = request
    try:
        yield response
    finally:
        await response.aclose()


async def _read_bounded(resp: httpx.Response, limit: int) -> bytes:
    buf = bytearray()
    async for chunk in resp.aiter_bytes():
        buf += chunk
        if len(buf) > limit:
            break
    return bytes(buf[:limit])


def _decode_compact(body: dict[str, Any]) -> Decoded:
    items = responses_output_items(body.get("output") or [])
    return items, "end_turn", _responses_usage(body.get("usage") or {})


async def attempt(
    pool: ClientShards,
    req: ModelCallRequest,
    *,
    api_key: str | None,
    attempt_no: int,
    http_timeout: httpx.Timeout,
    on_deltas: OnDeltas,
    max_response_bytes: int,
) -> Decoded:
    """Make one attempt; raise a ``ModelError`` on any failure."""
    provider = req["route"]["provider"]
    stream = req["stream"] and req["op"] == "respond"
    what = f"{provider} {req['route']['model']}"
    started = False
    url: httpx.URL | None = None  # named in connection errors
    try:
        request = build_request(req, api_key=api_key, attempt_no=attempt_no, stream=stream,
                                http_timeout=http_timeout)
        url = request.url
        async with pool.lease(request.url) as transport, \
                open_stream(transport, request) as resp:
            if resp.status_code >= 400:
                raise from_status(resp.status_code,
                                  await _read_bounded(resp, MAX_ERROR_BODY_BYTES),
                                  resp.headers, what)
            started = True
            ctype = resp.headers.get("content-type", "")
            if stream and ctype.startswith("text/event-stream"):
                return await read_stream(resp.aiter_bytes(), provider, on_deltas)
            raw = await _read_bounded(resp, max_response_bytes + 1)
            if len(raw) > max_response_bytes:
                raise StreamError(f"{what}: reply larger than {max_response_bytes} bytes")
            try:
                body = json.loads(raw)
            except ValueError as exc:
                raise StreamError(f"{what}: reply is not JSON") from exc
            if not isinstance(body, dict):
                raise StreamError(f"{what}: reply is not a JSON object")
            if req["op"] == "compact":
                return _decode_compact(body)
            return decoder_for(provider).from_json(body)
    except ModelError:
        raise
    except httpx.HTTPError as exc:
        raise from_httpx(exc, what, streaming=started, url=url) from exc
    except httpx.InvalidURL as exc:
        raise BadRequestError(f"{what}: invalid URL ({exc})") from exc
    except SSEError as exc:
        raise StreamError(f"{what}: malformed event stream ({exc})") from exc


async def read_stream(reads: AsyncIterable[bytes], provider: str, on_deltas: OnDeltas
                      ) -> Decoded:
    """Decode a provider's SSE byte stream, relaying its deltas as they come.

    Until the first delta is out, a read is parsed one event at a time: a large
    first read (a fast provider, a proxy that coalesces events; up to 64 KiB,
    about 0.3-1 ms of parsing) does not hold back the first token. After that,
    each read is parsed whole, so deltas arriving together are relayed together.
    Raises ``SSEError`` (malformed stream) or a decoder's ``ModelError``.
    """
    parser = SSEParser()
    decoder = decoder_for(provider)
    first = True
    async for chunk in reads:
        start, size = 0, len(chunk)
        while start < size:
            end = size
            if first:
                cut = chunk.find(b"\n\n", start)  # LF framing; otherwise the whole read
                if cut >= 0:
                    end = cut + 2
            deltas: list[ModelDelta] = []
            for event in parser.feed(chunk[start:end]):
                deltas.extend(decoder.feed(event))
                if first and deltas:
                    first = False
                    await on_deltas(deltas)
                    deltas = []
            if deltas:
                await on_deltas(deltas)
            start = end
    return decoder.finish()
