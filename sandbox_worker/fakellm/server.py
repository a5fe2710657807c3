"""The scripted provider: a real HTTP/1.1 server on asyncio streams (h11).

h11 is the sans-I/O HTTP/1.1 state machine that httpx/httpcore already
depend on, so the server adds no dependency, and one event loop with no
thread per connection serves on the order of a thousand concurrent
streaming requests on one core.

Routes (a ``/v1`` prefix is accepted on every OpenAI path too):

- ``POST /responses``, ``/chat/completions``, ``/v1/messages``: scripted replies,
  streamed (SSE) when the body says ``"stream": true``, else JSON;
- ``POST /responses/compact``: an opaque compaction item carrying ``k``;
- ``GET /_corral/stats``: request counts per path, per ``k``, per status;
  ``active`` requests in progress;
- ``GET /_corral/requests``: the last ``max_recorded`` requests (bounded),
  bodies as sent, credential headers reduced to their kind;
- ``POST /_corral/reset``: clears stats and recorded requests.

Invariants:
- The reply to a request depends only on its body and its attempt header
  (``script.count_outputs``), never on earlier requests.
- Request bodies are bounded (``MAX_BODY_BYTES``; 413 beyond); recorded
  requests are bounded; every connection task is owned by the server and
  cancelled by ``aclose``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import Counter, deque
from typing import Any, Final

import h11

from sandbox_worker.fakellm import wire
from sandbox_worker.fakellm.script import (
    Entry,
    Script,
    compaction_token,
    count_outputs,
)

log = logging.getLogger(__name__)

MAX_BODY_BYTES: Final = 16 * 1024 * 1024
READ_CHUNK: Final = 64 * 1024
ATTEMPT_HEADER: Final = b"x-corral-attempt"
DEFAULT_MAX_RECORDED: Final = 64
# Unpaced streams are written in batches of this many events (each its own HTTP chunk).
STREAM_BATCH_EVENTS: Final = 16
API_PATHS: Final = {"/responses": "responses", "/v1/responses": "responses",
                    "/chat/completions": "chat", "/v1/chat/completions": "chat",
                    "/v1/messages": "anthropic", "/messages": "anthropic",
                    "/responses/compact": "compact", "/v1/responses/compact": "compact"}


class _Closed(Exception):
    """The client went away."""


class FakeLLM:
    """Serves one script. ``await start()`` returns the base URL."""

    def __init__(self, script: Script, *, max_recorded: int = DEFAULT_MAX_RECORDED) -> None:
        self.script = script
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._recorded: deque[dict[str, Any]] = deque(maxlen=max_recorded)
        self._cache: dict[tuple[str, int, str, int], list[bytes]] = {}
        self.url = ""
        self.reset()

    def reset(self) -> None:
        self.requests = 0
        self.active = 0
        self.by_path: Counter[str] = Counter()
        self.by_k: Counter[str] = Counter()
        self.by_path_k: dict[str, Counter[str]] = {}
        self.by_status: Counter[str] = Counter()
        self.disconnects = 0
        self._recorded.clear()

    def stats(self) -> dict[str, Any]:
        return {"requests": self.requests, "active": self.active,
                "by_path": dict(self.by_path), "by_k": dict(self.by_k),
                "by_path_k": {p: dict(c) for p, c in self.by_path_k.items()},
                "by_status": dict(self.by_status), "disconnects": self.disconnects}

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._server = await asyncio.start_server(self._connection, host, port, backlog=4096,
                                                  limit=READ_CHUNK)
        sockname = self._server.sockets[0].getsockname()
        shown = f"[{sockname[0]}]" if ":" in sockname[0] else sockname[0]
        self.url = f"http://{shown}:{sockname[1]}"
        return self.url

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> FakeLLM:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ I/O

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        # asyncio (3.11) owns this callback task and logs an error if it ends
        # cancelled; the work runs in a task this server owns, which ``aclose``
        # cancels, and this wrapper just waits for it.
        task = asyncio.create_task(self._serve_connection(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        await asyncio.wait([task])

    async def _serve_connection(self, reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
        try:
            while True:
                request = await self._read_request(conn, reader)
                if request is None:
                    return
                req, body = request
                keep = await self._dispatch(conn, reader, writer, req, body)
                if not keep or conn.our_state is not h11.DONE \
                        or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (_Closed, ConnectionError, h11.ProtocolError):
            self.disconnects += 1
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _read_request(self, conn: h11.Connection, reader: asyncio.StreamReader
                            ) -> tuple[h11.Request, bytes] | None:
        req: h11.Request | None = None
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(READ_CHUNK)
                if not data and req is None:
                    return None
                conn.receive_data(data)
            elif isinstance(event, h11.Request):
                req = event
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_BODY_BYTES:
                    raise _Closed("request body too large")
            elif isinstance(event, h11.EndOfMessage):
                if req is None:
                    raise _Closed("message without a request")
                return req, bytes(body)
            elif isinstance(event, h11.ConnectionClosed):
                if req is None:
                    return None
                raise _Closed("client closed mid-request")
            else:
                return None

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, data: bytes | None) -> None:
        if data:
            writer.write(data)
            await writer.drain()

    async def _respond_json(self, conn: h11.Connection, writer: asyncio.StreamWriter,
                            status: int, obj: Any, extra: list[tuple[str, str]] | None = None,
                            cut_after_bytes: int | None = None) -> bool:
        payload = json.dumps(obj, separators=(",", ":")).encode()
        headers = [("content-type", "application/json"),
                   ("content-length", str(len(payload))), *(extra or [])]
        await self._send(writer, conn.send(h11.Response(status_code=status, headers=headers)))
        if cut_after_bytes is not None and cut_after_bytes < len(payload):
            await self._send(writer, conn.send(h11.Data(data=payload[:cut_after_bytes])))
            return False  # close without finishing the body
        await self._send(writer, conn.send(h11.Data(data=payload)))
        await self._send(writer, conn.send(h11.EndOfMessage()))
        return True

    # ------------------------------------------------------------- dispatch

    async def _dispatch(self, conn: h11.Connection, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter, req: h11.Request, body: bytes) -> bool:
        target = req.target.decode(errors="replace")
        if target.startswith(("http://", "https://")):
            # absolute-form (RFC 9112 3.2.2): what a client sends through an HTTP proxy
            target = "/" + target.split("://", 1)[1].partition("/")[2]
        path = target.split("?", 1)[0]
        method = req.method.decode()
        if path.startswith("/_corral/"):
            if method == "GET" and path == "/_corral/stats":
                return await self._respond_json(conn, writer, 200, self.stats())
            if method == "GET" and path == "/_corral/requests":
                return await self._respond_json(conn, writer, 200, list(self._recorded))
            if method == "POST" and path == "/_corral/reset":
                self.reset()
                return await self._respond_json(conn, writer, 200, {"ok": True})
            if method == "GET" and path == "/_corral/health":
                return await self._respond_json(conn, writer, 200, {"ok": True})
        api = API_PATHS.get(path)
        if api is None or method != "POST":
            return await self._respond_json(conn, writer, 404, wire.error_reply(
                "responses", 404, f"no route for {method} {path}"))
        error_api = "anthropic" if api == "anthropic" else "responses"
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            return await self._respond_json(conn, writer, 400, wire.error_reply(
                error_api, 400, "request body is not a JSON object"))
        headers = {name.lower(): value for name, value in req.headers}
        try:
            attempt = max(1, int(headers.get(ATTEMPT_HEADER, b"1")))
        except ValueError:
            attempt = 1
        k = count_outputs("responses" if api == "compact" else api, parsed)
        self._record(path, k, attempt, headers, parsed)
        self.active += 1
        try:
            return await self._scripted(conn, reader, writer, api, error_api, path, k,
                                        attempt, parsed, len(body))
        finally:
            self.active -= 1

    def _record(self, path: str, k: int, attempt: int, headers: dict[bytes, bytes],
                body: dict[str, Any]) -> None:
        self.requests += 1
        self.by_path[path] += 1
        self.by_k[str(k)] += 1
        self.by_path_k.setdefault(path, Counter())[str(k)] += 1
        auth = ("bearer" if b"authorization" in headers
                else "x-api-key" if b"x-api-key" in headers else None)
        self._recorded.append({
            "path": path, "k": k, "attempt": attempt, "auth": auth,
            "anthropic_version": headers.get(b"anthropic-version", b"").decode() or None,
            "body": body})

    async def _scripted(self, conn: h11.Connection, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter, api: str, error_api: str, path: str,
                        k: int, attempt: int, body: dict[str, Any], body_chars: int) -> bool:
        if api == "compact":
            entry = self.script.compact
        elif k >= len(self.script.responses):
            self.by_status["400"] += 1
            return await self._respond_json(conn, writer, 400, wire.error_reply(
                error_api, 400, f"fakellm: script exhausted: the request holds {k} model "
                f"outputs but the script has {len(self.script.responses)} responses"))
        else:
            entry = self.script.responses[k]
        if entry.delay_s:
            await asyncio.sleep(entry.delay_s)
        faulty = entry.faulty(attempt)
        if faulty and entry.hang:
            await self._hang(reader)
            return False
        if faulty and entry.status:
            self.by_status[str(entry.status)] += 1
            extra = [] if entry.retry_after_s is None else [
                ("retry-after", f"{entry.retry_after_s:g}")]
            message = entry.error_message or f"fakellm: scripted HTTP {entry.status}"
            return await self._respond_json(conn, writer, entry.status,
                                            wire.error_reply(error_api, entry.status, message),
                                            extra)
        self.by_status["200"] += 1
        cut = entry.cut_after_bytes if faulty else None
        model = str(body.get("model") or "scripted")
        usage = wire.usage_of(entry, body_chars)
        if api == "compact":
            reply = wire.compact_reply(body, compaction_token(k), k, model, usage)
            return await self._respond_json(conn, writer, 200, reply, cut_after_bytes=cut)
        if body.get("stream") is not True:
            return await self._respond_json(conn, writer, 200,
                                            wire.json_reply(api, entry, k, model, usage),
                                            cut_after_bytes=cut)
        key = (api, k, model, body_chars)
        events = self._cache.get(key)
        if events is None:
            events = wire.stream_events(api, entry, k, model, usage)
            if len(self._cache) > 256:
                self._cache.clear()
            self._cache[key] = events
        return await self._stream(conn, writer, events, entry, cut,
                                  malformed=faulty and entry.malformed)

    async def _hang(self, reader: asyncio.StreamReader) -> None:
        """Never answer; return when the client closes the connection."""
        while await reader.read(READ_CHUNK):
            pass

    async def _stream(self, conn: h11.Connection, writer: asyncio.StreamWriter,
                      events: list[bytes], entry: Entry, cut: int | None,
                      *, malformed: bool) -> bool:
        headers = [("content-type", "text/event-stream"), ("cache-control", "no-cache")]
        await self._send(writer, conn.send(h11.Response(status_code=200, headers=headers)))
        sent = 0
        batch: list[bytes] = []  # framed events not yet written (one syscall per batch)
        for i, event in enumerate(events):
            if malformed and i == len(events) // 2:
                event = b"data: {this is not json\n\n"
            if cut is not None and sent + len(event) > cut:
                batch.append(conn.send(h11.Data(data=event[:cut - sent])) or b"")
                await self._send(writer, b"".join(batch))
                return False  # the connection closes without the chunked terminator
            sent += len(event)
            batch.append(conn.send(h11.Data(data=event)) or b"")
            if entry.chunk_delay_s:
                await self._send(writer, b"".join(batch))
                batch.clear()
                await asyncio.sleep(entry.chunk_delay_s)
            elif len(batch) >= STREAM_BATCH_EVENTS:
                await self._send(writer, b"".join(batch))
                batch.clear()
        batch.append(conn.send(h11.EndOfMessage()) or b"")
        await self._send(writer, b"".join(batch))
        return True
