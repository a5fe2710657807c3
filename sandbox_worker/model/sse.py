"""Incremental Server-Sent Events parser (the WHATWG event-stream format).

Hand-written rather than a dependency: the adapters feed it raw network
chunks and need every complete event of a chunk at once, so that deltas
arriving together are relayed together (see ``relay``).

Invariants:
- ``feed`` returns only complete events (terminated by a blank line), in order.
- Lines may end in LF, CRLF or CR; a chunk boundary may fall anywhere,
  including inside a UTF-8 sequence or between CR and LF.
- The buffered, incomplete event never exceeds ``max_event_bytes``; beyond
  that ``SSEError`` is raised (a malformed or hostile stream).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

DEFAULT_MAX_EVENT_BYTES: Final = 4 * 1024 * 1024


class SSEError(ValueError):
    """The byte stream is not a valid, bounded event stream."""


@dataclass(frozen=True, slots=True)
class SSEEvent:
    event: str  # "message" when the stream gave no event name
    data: str


class SSEParser:
    """Feed bytes, get complete events."""

    def __init__(self, *, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self._buf = bytearray()
        self._max = max_event_bytes
        self._event = ""
        self._data: list[str] = []
        self._pending_bytes = 0
        self._skip_lf = False

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        if not self._skip_lf and b"\r" not in chunk and b"\r" not in self._buf:
            return self._feed_lf(chunk)
        self._buf += chunk
        events: list[SSEEvent] = []
        buf = self._buf
        start = 0
        if self._skip_lf and buf[:1] == b"\n":
            start = 1  # the LF of a CRLF split across chunks
        self._skip_lf = False
        n = len(buf)
        while start < n:
            lf = buf.find(b"\n", start)
            cr = buf.find(b"\r", start, lf if lf >= 0 else n)
            if cr >= 0:
                end = cr
                if cr + 1 >= n:
                    nxt = n
                    self._skip_lf = True  # a CR at the end: an LF may follow
                else:
                    nxt = cr + 2 if buf[cr + 1] == 0x0A else cr + 1
            elif lf >= 0:
                end, nxt = lf, lf + 1
            else:
                break
            line = bytes(buf[start:end])
            start = nxt
            self._line(line, events)
        del buf[:start]
        if len(buf) + self._pending_bytes > self._max:
            raise SSEError(f"event larger than {self._max} bytes")
        return events

    def _feed_lf(self, chunk: bytes) -> list[SSEEvent]:
        """Fast path: LF-only line endings (what providers send)."""
        events: list[SSEEvent] = []
        if self._buf:
            self._buf += chunk
            lines = bytes(self._buf).split(b"\n")
        else:
            lines = chunk.split(b"\n")
        rest = lines.pop()
        limit = self._max
        for raw in lines:
            # The three lines providers send, inline (``_line`` does the rest):
            # "data: ...", "event: ...", and the blank line that ends an event.
            if not raw:
                self._end_event(events)
                continue
            head = raw[:6]
            if head == b"data: " or (head == b"event:" and raw[6:7] == b" "):
                self._pending_bytes += len(raw)
                if self._pending_bytes > limit:
                    raise SSEError(f"event larger than {limit} bytes")
                try:
                    if head == b"data: ":
                        self._data.append(raw[6:].decode("utf-8"))
                    else:
                        self._event = raw[7:].decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise SSEError("event stream is not valid UTF-8") from exc
            else:
                self._line(raw, events)
        self._buf = bytearray(rest)
        if len(rest) + self._pending_bytes > self._max:
            raise SSEError(f"event larger than {self._max} bytes")
        return events

    def _end_event(self, events: list[SSEEvent]) -> None:
        """A blank line: the buffered event (if it has data) is complete."""
        if self._data:
            events.append(SSEEvent(self._event or "message", "\n".join(self._data)))
        self._event = ""
        self._data = []
        self._pending_bytes = 0

    def _line(self, raw: bytes, events: list[SSEEvent]) -> None:
        if not raw:
            self._end_event(events)
            return
        self._pending_bytes += len(raw)
        if self._pending_bytes > self._max:
            raise SSEError(f"event larger than {self._max} bytes")
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SSEError("event stream is not valid UTF-8") from exc
        if line.startswith(":"):
            return  # a comment (keep-alive)
        field, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        # "id" and "retry" are irrelevant to one-shot model streams.

    @property
    def has_partial_event(self) -> bool:
        """True when bytes of an unfinished event are buffered."""
        return bool(self._buf) or bool(self._data)
