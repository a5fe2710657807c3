"""OpenTelemetry spans of the supervisor, built from committed events and calls.

Span tree of one turn (all ``corral-supervisor``):

    turn                                  TURN_STARTED .. TURN_COMPLETE/ABORTED
    ├── chat {model}            (client)  one model step's request (begin .. end)
    ├── approval                          EXEC_APPROVAL_REQUEST .. next call/turn end
    ├── execute_tool {name}     (client)  TOOL_CALL_BEGIN .. TOOL_CALL_END
    ├── hook {event}                      each hook run (``hooks.set_hook_observer``)
    └── compaction                        compaction block pending .. complete

A model step is its request's span and a tool call its ``execute_tool``
span: no separate span for the request (each span costs about 0.14 ms of the
supervisor's CPU on the 2-core test machine, with as much again to export
it). Their context travels to the worker as the payload's ``trace``
(``broker.otel``), so the worker's spans and the broker's ``broker
dispatch`` span are their children. A request that
fails (``worker_lost`` when its worker died) marks its span with status ERROR
and ``error.type`` = the failure kind.

A turn's trace id is derived from its turn id (``trace_id_of``): a restarted
supervisor that resumes the turn continues the same trace, with a
``turn (resumed)`` span, without storing anything.

Attributes follow the GenAI semantic conventions (``gen_ai.system``,
``gen_ai.operation.name``, ``gen_ai.request.model``, ``gen_ai.usage.*``,
``gen_ai.tool.name``, ``gen_ai.tool.call.id``, ``gen_ai.conversation.id``).
Prompts, tool arguments and outputs are recorded only with
``record_content``; API keys never (requests carry a credential *name*).

Sampling (the standard ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``,
read by the SDK) decides per turn, at its root span. A turn sampled out gets
no child span, no attribute and no export: its requests carry its context
with flags ``00`` (``_Unsampled``), so the broker's and the workers'
parent-based samplers drop theirs too.

Invariants: every span opened here is ended (turn end ends the turn's open
children; ``MAX_OPEN`` bounds what a lost event could leave open).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from broker import otel
from broker.protocol import Failure
from supervisor.engine import events as ev
from supervisor.store.records import EventRecord

log = logging.getLogger(__name__)

MAX_OPEN = 10_000
MAX_CONTENT = 4096  # characters of content kept per attribute (record_content)


def trace_id_of(turn_id: str) -> int:
    return int.from_bytes(hashlib.sha256(turn_id.encode()).digest()[:16], "big") or 1


class _TurnIds(RandomIdGenerator):
    """Random ids, except a turn span's trace id, derived from its turn id."""

    def __init__(self) -> None:
        self.next_trace_id: int | None = None

    def generate_trace_id(self) -> int:
        if self.next_trace_id is not None:
            value, self.next_trace_id = self.next_trace_id, None
            return value
        return super().generate_trace_id()


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class _Turn:
    def __init__(self, span: Span) -> None:
        self.span = span
        # A turn the sampler dropped gets no child span at all: its calls carry
        # its (unsampled) context so the broker and the workers drop theirs too.
        self.recording = span.is_recording()
        self.unsampled = None if self.recording else _Unsampled(span)
        self.tools: dict[str, Span] = {}
        self.approvals: dict[str, Span] = {}
        self.compactions: dict[str, Span] = {}

    def children(self) -> list[Span]:
        return [*self.tools.values(), *self.approvals.values(), *self.compactions.values()]


class SupervisorTracer:
    def __init__(self, *, record_content: bool = False, endpoint: str | None = None,
                 provider: TracerProvider | None = None) -> None:
        self.record_content = record_content
        self._ids = _TurnIds()
        if provider is not None:  # a given provider (tests) gets the turn ids too
            provider.id_generator = self._ids
        self.provider = provider or otel.configure("corral-supervisor", endpoint,
                                                   id_generator=self._ids)
        self.tracer = self.provider.get_tracer("corral.supervisor")
        self._turns: OrderedDict[str, _Turn] = OrderedDict()
        self._session_turn: dict[str, str] = {}
        self._call_turn: dict[str, str] = {}

    def shutdown(self) -> None:
        otel.shutdown(self.provider)  # bounded: a hung collector must not hold the stop

    # ------------------------------------------------------------- events

    def committed(self, events: list[EventRecord], seconds: float) -> None:
        for record in events:
            self._event(record)

    def _turn(self, record: EventRecord, *, resumed: bool = True) -> _Turn | None:
        turn_id = record.payload.get("turn_id")
        if not isinstance(turn_id, str):
            return None
        turn = self._turns.get(turn_id)
        if turn is None and resumed:
            turn = self._start_turn(record, turn_id, "turn (resumed)")
        return turn

    def _start_turn(self, record: EventRecord, turn_id: str, name: str) -> _Turn:
        self._ids.next_trace_id = trace_id_of(turn_id)
        try:
            span = self.tracer.start_span(
                name, context=trace.set_span_in_context(trace.INVALID_SPAN),
                start_time=_ns(record.created_at),
                attributes={"gen_ai.conversation.id": record.session_id,
                            "corral.turn.id": turn_id})
        finally:
            self._ids.next_trace_id = None
        turn = _Turn(span)
        self._turns[turn_id] = turn
        self._session_turn[record.session_id] = turn_id
        while len(self._turns) > MAX_OPEN:
            _, old = self._turns.popitem(last=False)
            self._end_turn(old, None, "evicted")
        return turn

    def _child(self, turn: _Turn, name: str, record: EventRecord,
               attributes: dict[str, Any]) -> Span:
        return self.tracer.start_span(name, context=trace.set_span_in_context(turn.span),
                                      start_time=_ns(record.created_at),
                                      attributes=attributes)

    def _end_turn(self, turn: _Turn, end_ns: int | None, outcome: str) -> None:
        for span in turn.children():
            span.set_attribute("corral.outcome", "open_at_turn_end")
            span.end(end_time=end_ns)
        turn.span.set_attribute("corral.outcome", outcome)
        if outcome not in ("completed", "evicted"):
            turn.span.set_status(Status(StatusCode.ERROR, outcome))
        turn.span.end(end_time=end_ns)

    def _event(self, record: EventRecord) -> None:
        p, t, at = record.payload, record.type, _ns(record.created_at)
        if t == ev.TURN_STARTED:
            turn_id = p.get("turn_id")
            if isinstance(turn_id, str) and turn_id not in self._turns:
                self._start_turn(record, turn_id, "turn")
            return
        turn = self._turn(record)
        if turn is None:
            return
        if t in ev.TERMINAL_TURN_TYPES:
            self._turns.pop(str(p.get("turn_id")), None)
            reason = "completed" if t == ev.TURN_COMPLETE else str(p.get("reason"))
            self._end_turn(turn, at, reason)
        elif not turn.recording:  # sampled out: only the call -> turn map is kept
            if t == ev.TOOL_CALL_BEGIN:
                self._map_call(str(p.get("call_id")), str(p.get("turn_id")))
            elif t == ev.TOOL_CALL_END:
                self._call_turn.pop(str(p.get("call_id")), None)
        elif t == ev.TOOL_CALL_BEGIN:
            call_id = str(p.get("call_id"))
            for span in turn.approvals.values():
                span.end(end_time=at)
            turn.approvals.clear()
            attrs: dict[str, Any] = {"gen_ai.operation.name": "execute_tool",
                                     "gen_ai.tool.name": str(p.get("name")),
                                     "gen_ai.tool.call.id": call_id}
            if self.record_content:
                attrs["gen_ai.tool.call.arguments"] = json.dumps(
                    p.get("arguments"), default=str)[:MAX_CONTENT]
            old = turn.tools.pop(call_id, None)
            if old is not None:
                old.end(end_time=at)
            turn.tools[call_id] = self.tracer.start_span(
                f"execute_tool {p.get('name')}", context=trace.set_span_in_context(turn.span),
                kind=SpanKind.CLIENT, start_time=at, attributes=attrs)
            self._map_call(call_id, str(p.get("turn_id")))
        elif t == ev.TOOL_CALL_END:
            call_id = str(p.get("call_id"))
            tool_span = turn.tools.pop(call_id, None)
            self._call_turn.pop(call_id, None)
            if tool_span is not None:
                outcome = str(p.get("outcome"))
                ended: dict[str, Any] = {"corral.outcome": outcome}
                isolation = p.get("isolation")
                if isinstance(isolation, dict) and isinstance(isolation.get("tier"), str):
                    ended["corral.sandbox.tier"] = isolation["tier"]
                if self.record_content and isinstance(p.get("output"), str):
                    ended["gen_ai.tool.call.result"] = p["output"][:MAX_CONTENT]
                tool_span.set_attributes(ended)  # one call: the SDK locks and checks per call
                if outcome != "ok":
                    tool_span.set_status(Status(StatusCode.ERROR, outcome))
                tool_span.end(end_time=at)
        elif t == ev.EXEC_APPROVAL_REQUEST:
            approval_id = str(p.get("id"))
            turn.approvals[approval_id] = self._child(turn, "approval", record,
                                                      {"corral.approval.id": approval_id})
        elif t == ev.FRONTEND_RENDER and p.get("capability") == ev.COMPACTION_CAPABILITY:
            block = p.get("block") or {}
            block_id = str(block.get("id"))
            if block.get("state") == "pending":
                turn.compactions[block_id] = self._child(turn, "compaction", record, {})
            else:
                block_span = turn.compactions.pop(block_id, None)
                if block_span is not None:
                    block_span.set_attribute("corral.outcome", str(block.get("title")))
                    block_span.end(end_time=at)

    def _map_call(self, call_id: str, turn_id: str) -> None:
        self._call_turn[call_id] = turn_id
        while len(self._call_turn) > MAX_OPEN:
            self._call_turn.pop(next(iter(self._call_turn)))

    # -------------------------------------------------------------- hooks

    def hook(self, name: str, event: str, session_id: str,
             turn_id: str | None) -> Callable[[BaseException | None], None]:
        """A ``hook EVENT`` span under its turn (``hooks.set_hook_observer``)."""
        turn = self._turns.get(turn_id) if turn_id else None
        if turn is not None and not turn.recording:
            return _not_traced
        ctx = trace.set_span_in_context(turn.span) if turn is not None else None
        span = self.tracer.start_span(f"hook {event}", context=ctx, attributes={
            "corral.hook.name": name, "corral.hook.event": event,
            "gen_ai.conversation.id": session_id})

        def ended(exc: BaseException | None) -> None:
            if exc is not None:
                kind = getattr(exc, "kind", None) or type(exc).__name__
                span.set_attribute("error.type", str(kind))
                span.set_status(Status(StatusCode.ERROR, str(kind)))
            span.end()

        return ended

    # -------------------------------------------------------------- calls

    def begin(self, service: str, payload: dict[str, Any]) -> _CallSpan | _Unsampled | None:
        if service == "model":
            turn_id = self._session_turn.get(str(payload.get("session_id")))
            turn = self._turns.get(turn_id) if turn_id else None
            if turn is not None and turn.unsampled is not None:
                return turn.unsampled
            raw = payload.get("route")
            route: dict[str, Any] = raw if isinstance(raw, dict) else {}
            model = str(route.get("model"))
            attrs: dict[str, Any] = {
                "gen_ai.operation.name": "chat", "gen_ai.system": str(route.get("provider")),
                "gen_ai.request.model": model, "corral.route": str(route.get("name"))}
            if self.record_content:
                attrs["gen_ai.input.messages"] = json.dumps(
                    payload.get("items"), default=str)[-MAX_CONTENT:]
            ctx = trace.set_span_in_context(turn.span) if turn is not None else None
            return _CallSpan(self.tracer.start_span(f"chat {model}", context=ctx,
                                                    kind=SpanKind.CLIENT, attributes=attrs),
                             owned=True)
        if service == "tool":
            call_id = str(payload.get("call_id"))
            turn_id = self._call_turn.get(call_id)
            turn = self._turns.get(turn_id) if turn_id else None
            if turn is not None and turn.unsampled is not None:
                return turn.unsampled
            span = turn.tools.get(call_id) if turn is not None else None
            if span is not None:  # the call's execute_tool span, ended by TOOL_CALL_END
                return _CallSpan(span, owned=False)
            return _CallSpan(self.tracer.start_span(
                f"execute_tool {payload.get('tool')}", kind=SpanKind.CLIENT,
                attributes={"gen_ai.tool.name": str(payload.get("tool"))}), owned=True)
        return None


def _not_traced(exc: BaseException | None) -> None:
    return None


class _Unsampled:
    """The call sink of every request of a turn the sampler dropped: its
    context (flags 00) and nothing else, so no span, attribute or export
    costs anything downstream either."""

    def __init__(self, span: Span) -> None:
        sc = span.get_span_context()
        self.trace: str | None = otel.format_traceparent(sc.trace_id, sc.span_id, False)

    def first_partial(self, ttft_s: float) -> None:
        return None

    def end(self, reply: Any, failure: Failure | None, duration_s: float) -> None:
        return None


class _CallSpan:
    """One request's client span (``hub.CallSink``); ``owned``: ended here."""

    def __init__(self, span: Span, *, owned: bool) -> None:
        self.span = span
        self.owned = owned
        sc = span.get_span_context()
        self.trace: str | None = otel.format_traceparent(sc.trace_id, sc.span_id,
                                                         sc.trace_flags.sampled)

    def first_partial(self, ttft_s: float) -> None:
        self.span.set_attribute("corral.time_to_first_chunk_s", round(ttft_s, 6))

    def end(self, reply: Any, failure: Failure | None, duration_s: float) -> None:
        if failure is not None:
            self.span.set_attribute("error.type", failure.kind)
            self.span.set_status(Status(StatusCode.ERROR, failure.kind))
        elif isinstance(reply, dict):
            attrs: dict[str, Any] = {}
            usage = reply.get("usage")
            if isinstance(usage, dict):
                for key, attr in (("input", "gen_ai.usage.input_tokens"),
                                  ("output", "gen_ai.usage.output_tokens")):
                    if isinstance(usage.get(key), int):
                        attrs[attr] = usage[key]
            if isinstance(reply.get("model"), str):
                attrs["gen_ai.response.model"] = reply["model"]
            if isinstance(reply.get("stop_reason"), str):
                attrs["gen_ai.response.finish_reasons"] = (reply["stop_reason"],)
            if attrs:
                self.span.set_attributes(attrs)  # one call: the SDK locks and checks per call
        if self.owned:
            self.span.end()
