"""The farm's read-only live web view, served by the supervisor.

Standard library only (``http.server.ThreadingHTTPServer`` in a daemon
thread): the page is two static files of this package (``static/``, plain
HTML and JS, no build step) and three read-only JSON/SSE endpoints:

- ``GET /api/farm``: one snapshot (workers by host with tier, load and last
  heartbeat; sessions with state and current turn, at most
  ``MAX_SESSIONS_SHOWN``: those with a turn or a pending approval first, then
  the most recent, and ``sessions_total``; every pending approval of the
  loaded sessions, up to the same bound; recent restarts; counters for the
  small charts), taken on the event loop;
- ``GET /api/events`` (server-sent events): every committed durable event of
  every session (type, session, sequence, a clipped summary), and a ``farm``
  snapshot every ``SNAPSHOT_INTERVAL_S``;
- ``GET /api/history?session=ID``: that session's last ``HISTORY_LIMIT``
  durable events (from the store), so a selected session shows its past.

Access: a loopback address needs nothing more (and the ``Host`` header must
name it, against DNS rebinding); any other address needs the farm's token
(HOME/web.token, 0600, made by ``ensure_token``; ``corral up`` prints it),
given once as ``?token=`` (then kept in an HttpOnly, SameSite=Strict cookie)
or as ``Authorization: Bearer``. Only GET and HEAD exist; nothing on the
page changes anything (approvals stay in the CLI and the API).

Invariants:
- Every response carries the security headers (CSP without inline script,
  nosniff, frame denial, no referrer, no-store, same-origin isolation).
- Every SSE subscriber has a bounded queue; one that falls behind is closed,
  never the loop or another subscriber. At most ``MAX_STREAMS`` streams.
- The page puts server text in the DOM with ``textContent`` only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import ipaddress
import json
import logging
import os
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from broker.protocol import Failure
from supervisor.engine.manager import SessionManager
from supervisor.store.records import EventRecord, SessionId
from supervisor.telemetry.setup import split_host_port

log = logging.getLogger(__name__)

TOKEN_FILE = "web.token"
COOKIE = "corral_web"
SNAPSHOT_INTERVAL_S = 1.0
SNAPSHOT_TIMEOUT_S = 3.0
QUEUE_LIMIT = 1000
MAX_STREAMS = 32
MAX_SESSIONS_SHOWN = 200
HISTORY_LIMIT = 200
SUMMARY_CHARS = 300
RECENT_FAULTS = 50
STATIC = {"/": ("index.html", "text/html; charset=utf-8"),
          "/app.js": ("app.js", "text/javascript; charset=utf-8"),
          "/app.css": ("app.css", "text/css; charset=utf-8")}
SECURITY_HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; "
                                "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                                "form-action 'none'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Permissions-Policy": "camera=(), microphone=(), geolocation=()",
}
Snapshot = Callable[[], Coroutine[Any, Any, Any]]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name in a ``Host`` header: ``[::1]:8765`` and ``[::1]`` -> ``::1``,
    ``localhost:8765`` -> ``localhost``."""
    h = header.strip()
    if h.startswith("["):
        end = h.find("]")
        return h[1:end] if end > 0 else ""
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def ensure_token(home: Path) -> str:
    """The farm's web token (HOME/web.token, 0600), made on first use."""
    path = home / TOKEN_FILE
    try:
        token = path.read_text().strip()
        if len(token) >= 32:
            return token
    except FileNotFoundError:
        pass
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(path, 0o600)
    return token


def _summary(payload: dict[str, Any]) -> str:
    text = json.dumps(payload, default=str, ensure_ascii=False)
    return text if len(text) <= SUMMARY_CHARS else text[:SUMMARY_CHARS] + "…"


class WebView:
    def __init__(self, listen: str, *, manager: SessionManager, snapshot: Snapshot,
                 home: Path, loop: asyncio.AbstractEventLoop) -> None:
        self.host, self.port = split_host_port(listen)
        self.manager = manager
        self.status = snapshot
        self.home = home
        self.loop = loop
        self.token = None if is_loopback(self.host) else ensure_token(home)
        self.counters: dict[str, int] = {"turns_started": 0, "turns_ended": 0,
                                         "tool_calls": 0, "model_calls": 0, "failures": 0}
        self.faults: deque[dict[str, Any]] = deque(maxlen=RECENT_FAULTS)
        self._streams: set[queue.Queue[bytes | None]] = set()
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()

    # ------------------------------------------------------------ sink side

    def committed(self, events: list[EventRecord], seconds: float) -> None:
        if not events:
            return
        for record in events:
            if record.type == "turn_started":
                self.counters["turns_started"] += 1
            elif record.type in ("turn_complete", "turn_aborted"):
                self.counters["turns_ended"] += 1
            elif record.type == "tool_call_end":
                self.counters["tool_calls"] += 1
            elif record.type == "error":
                self.faults.append({"at": record.created_at, "session_id": record.session_id,
                                    "kind": str(record.payload.get("kind")),
                                    "message": str(record.payload.get("message"))[:200]})
        with self._lock:
            if not self._streams:
                return
        for record in events:
            self._broadcast("event", {
                "session_id": record.session_id, "sequence": record.sequence,
                "type": record.type, "at": record.created_at,
                "turn_id": record.payload.get("turn_id"),
                "summary": _summary(record.payload)})

    def begin(self, service: str, payload: dict[str, Any]) -> _Count:
        return _Count(self, service)

    def _broadcast(self, kind: str, data: Any) -> None:
        frame = f"event: {kind}\ndata: {json.dumps(data, default=str)}\n\n".encode()
        with self._lock:
            streams = list(self._streams)
        for q in streams:
            try:
                q.put_nowait(frame)
            except queue.Full:  # a slow viewer: close its stream, keep the others
                with self._lock:
                    self._streams.discard(q)
                while True:  # drop its backlog, then tell its thread to end
                    try:
                        q.get_nowait()
                    except queue.Empty:
                        break
                with contextlib.suppress(queue.Full):  # the ticker may race us
                    q.put_nowait(None)

    # ---------------------------------------------------------- snapshots

    async def _snapshot(self) -> dict[str, Any]:
        status = await self.status()
        sessions: list[dict[str, Any]] = []
        approvals: list[dict[str, Any]] = []
        loaded = list(self.manager.sessions.values())
        # Bounded, and what needs an eye first: every session with a turn or a
        # pending approval (up to the bound), then the most recent others.
        busy = [s for s in loaded if s.driver is not None or s.state.pending_approval]
        if len(busy) < MAX_SESSIONS_SHOWN:
            keep = {id(s) for s in busy}
            rest = [s for s in loaded if id(s) not in keep]
            busy += rest[len(rest) - (MAX_SESSIONS_SHOWN - len(busy)):]
        shown = {id(s) for s in busy[:MAX_SESSIONS_SHOWN]}
        for s in loaded:
            st = s.state
            if st.pending_approval and len(approvals) < MAX_SESSIONS_SHOWN:
                pa = st.pending_approval
                approvals.append({"session_id": s.sid, "id": pa.get("id"),
                                  "turn_id": pa.get("turn_id"),
                                  "calls": [c.get("name") for c in pa.get("calls", [])
                                            if isinstance(c, dict)][:10]})
            if id(s) not in shown:
                continue
            turn = st.active_turn or {}
            state = "closed" if s.closed else ("busy" if s.driver is not None else "idle")
            sessions.append({"session_id": s.sid, "state": state,
                             "turn_id": turn.get("turn_id"), "phase": turn.get("phase"),
                             "route": s.route_name,
                             "last_sequence": st.next_event_sequence - 1})
        farm: Any = None
        try:
            farm = json.loads((self.home / "farm.json").read_text())
        except (OSError, ValueError):
            farm = None
        restarts = (farm or {}).get("restarts", [])[-RECENT_FAULTS:] \
            if isinstance(farm, dict) else []
        return {"at": time.time(), "status": status, "sessions": sessions,
                "sessions_total": len(loaded),
                "approvals": approvals, "restarts": restarts, "faults": list(self.faults),
                "counters": dict(self.counters)}

    def snapshot(self) -> dict[str, Any]:
        """One snapshot, taken on the event loop (called from a server thread)."""
        fut = asyncio.run_coroutine_threadsafe(self._snapshot(), self.loop)
        try:
            return fut.result(SNAPSHOT_TIMEOUT_S)
        except (concurrent.futures.TimeoutError, RuntimeError) as exc:
            fut.cancel()
            return {"at": time.time(), "error": f"no snapshot: {exc}"}

    def history(self, session_id: str) -> list[dict[str, Any]]:
        async def read() -> list[dict[str, Any]]:
            out: list[dict[str, Any]] = []
            async for r in self.manager.replay_from(SessionId(session_id), 0):
                out.append({"session_id": r.session_id, "sequence": r.sequence,
                            "type": r.type, "at": r.created_at,
                            "turn_id": r.payload.get("turn_id"),
                            "summary": _summary(r.payload)})
                if len(out) > 10 * HISTORY_LIMIT:
                    del out[:-HISTORY_LIMIT]
            return out[-HISTORY_LIMIT:]

        fut = asyncio.run_coroutine_threadsafe(read(), self.loop)
        try:
            return fut.result(SNAPSHOT_TIMEOUT_S)
        except (concurrent.futures.TimeoutError, RuntimeError, Exception):
            fut.cancel()
            return []

    # ------------------------------------------------------------- server

    def start(self, port: int | None = None) -> str:
        """Serve on ``port`` (default: the one configured); the URL served."""
        view = self

        class Handler(_Handler):
            web = view

        server = ThreadingHTTPServer((self.host, self.port if port is None else port), Handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="web-view",
                                        daemon=True)
        self._thread.start()
        self._ticker = threading.Thread(target=self._tick, name="web-view-ticker",
                                        daemon=True)
        self._ticker.start()
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{shown}:{server.server_port}/"

    def _tick(self) -> None:
        while not self._stop.wait(SNAPSHOT_INTERVAL_S):
            with self._lock:
                idle = not self._streams
            if not idle:
                self._broadcast("farm", self.snapshot())

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            streams = list(self._streams)
            self._streams.clear()
        for q in streams:
            with contextlib.suppress(queue.Full):
                q.put_nowait(None)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        for t in (self._thread, self._ticker):
            if t is not None:
                t.join(5)

    def subscribe(self) -> queue.Queue[bytes | None] | None:
        q: queue.Queue[bytes | None] = queue.Queue(QUEUE_LIMIT)
        with self._lock:
            if len(self._streams) >= MAX_STREAMS:
                return None
            self._streams.add(q)
        return q

    def unsubscribe(self, q: queue.Queue[bytes | None]) -> None:
        with self._lock:
            self._streams.discard(q)


class _Count:
    """Counts model calls and failed requests for the charts (``hub.CallSink``)."""

    trace: str | None = None

    def __init__(self, web: WebView, service: str) -> None:
        self.web = web
        self.service = service

    def first_partial(self, ttft_s: float) -> None:
        pass

    def end(self, reply: Any, failure: Failure | None, duration_s: float) -> None:
        if self.service == "model":
            self.web.counters["model_calls"] += 1
        if failure is not None:
            self.web.counters["failures"] += 1
            if failure.kind not in ("cancelled",):
                self.web.faults.append({"at": time.time(), "session_id": None,
                                        "kind": failure.kind, "service": self.service,
                                        "message": failure.message[:200]})


class _Handler(BaseHTTPRequestHandler):
    web: WebView
    server_version = "corral-web"
    sys_version = ""
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("web: " + format, *args)

    def _headers(self, status: int, content_type: str, length: int | None,
                 extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in SECURITY_HEADERS.items():
            self.send_header(k, v)
        self.send_header("Content-Type", content_type)
        if length is not None:
            self.send_header("Content-Length", str(length))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()

    def _send(self, status: int, body: bytes, content_type: str,
              extra: dict[str, str] | None = None) -> None:
        self._headers(status, content_type, len(body), extra)
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, data: Any) -> None:
        self._send(200, json.dumps(data, default=str).encode(), "application/json")

    def _refuse(self, status: int, why: str) -> None:
        self._send(status, (why + "\n").encode(), "text/plain; charset=utf-8")

    def _allowed(self, query: dict[str, list[str]]) -> tuple[bool, dict[str, str]]:
        web = self.web
        host = host_name(self.headers.get("Host") or "")
        if web.token is None:
            # Loopback: the Host must name loopback too (a DNS-rebinding page
            # would send its own name).
            return is_loopback(host), {}
        given = None
        auth = self.headers.get("Authorization") or ""
        if auth.startswith("Bearer "):
            given = auth[len("Bearer "):].strip()
        for part in (self.headers.get("Cookie") or "").split(";"):
            name, _, value = part.strip().partition("=")
            if name == COOKIE and given is None:
                given = value
        tokens = query.get("token") or []
        from_query = tokens[0] if tokens else None
        if given is None and from_query is not None:
            given = from_query
        if given is None or not hmac.compare_digest(given.encode(), web.token.encode()):
            return False, {}
        if from_query is not None:
            return True, {"Set-Cookie": f"{COOKIE}={web.token}; HttpOnly; SameSite=Strict; "
                                        "Path=/"}
        return True, {}

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        ok, extra = self._allowed(query)
        if not ok:
            self._refuse(403, "forbidden: this view needs the farm's token (corral up "
                         "printed it; it is in HOME/web.token)")
            return
        if url.path in STATIC:
            name, ctype = STATIC[url.path]
            body = resources.files("supervisor.telemetry").joinpath("static", name).read_bytes()
            self._send(200, body, ctype, extra)
        elif url.path == "/api/farm":
            self._json(self.web.snapshot())
        elif url.path == "/api/history":
            sid = (query.get("session") or [""])[0]
            self._json(self.web.history(sid[:200]) if sid else [])
        elif url.path == "/api/events":
            self._stream()
        else:
            self._refuse(404, "not found")

    def _stream(self) -> None:
        q = self.web.subscribe()
        if q is None:
            self._refuse(503, "too many live viewers")
            return
        try:
            self._headers(200, "text/event-stream", None, {"Connection": "close"})
            self.close_connection = True
            first = f"event: farm\ndata: {json.dumps(self.web.snapshot(), default=str)}\n\n"
            self.wfile.write(first.encode())
            self.wfile.flush()
            while True:
                try:
                    frame = q.get(timeout=15)
                except queue.Empty:
                    frame = b": keep-alive\n\n"
                if frame is None:
                    return
                self.wfile.write(frame)
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, OSError):
            return
        finally:
            self.web.unsubscribe(q)

    def _method_not_allowed(self) -> None:
        self._send(405, b"read-only\n", "text/plain; charset=utf-8", {"Allow": "GET, HEAD"})

    do_POST = do_PUT = do_DELETE = do_PATCH = _method_not_allowed
