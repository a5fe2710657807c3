"""The broker's dispatch state machine: pure bookkeeping, no sockets, no clocks.

``Dispatcher`` takes decoded messages and the current time (``now``, from
``time.monotonic()`` in the caller) and returns the list of ``Send`` actions to
perform. ``broker.server`` is the socket loop around it; tests drive it
directly, including a Hypothesis ``RuleBasedStateMachine``. Its records
(limits, actions, entries) are in ``broker.records``.

One source of truth (no parallel lists that can disagree):

- ``_requests`` (keyed by the broker's own request id) holds every request the
  broker still has to care about. Each one is either *queued* (``worker is
  None``, present in exactly one service queue) or *held* by exactly one live,
  registered worker (``worker`` set, present in that worker's ``in_flight``).
- ``closed`` says whether the client already got its final answer (or left).
  A held request that is closed still occupies its worker's slot until the
  worker answers it (the late answer is dropped and counted) or expires.
  A queued request is never closed: closing it removes it.
- The client's ``pending`` map indexes exactly the requests that are not closed.
  Every request gets exactly one final answer (REPLY or FAILURE) unless its
  client went away.
- Idle sets list exactly the registered workers with a free slot, per service,
  least recently used first.

Bounds: per-service queue length, number of distinct queued services,
workers, clients and tracked requests (all in ``Limits``). Over a bound a
request is answered FAILURE(overloaded, retryable) and other input is dropped
and counted in ``dropped[reason]``.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable
from typing import Any

from broker import plants, protocol  # plants: chaos plant switches
from broker.protocol import FailureKind
from broker.records import (
    MAX_STATUS_CLIENTS,
    ClientEntry,
    Forward,
    Limits,
    Req,
    Send,
    Side,
    WorkerEntry,
    new_broker_id,
    peer_name,
)

__all__ = ["Dispatcher", "Forward", "Limits", "Send", "Side", "new_broker_id"]


class Dispatcher:
    """Pure dispatch state machine. Every public method returns the actions to perform."""

    def __init__(self, broker_id: str, limits: Limits, now: float) -> None:
        self.broker_id = broker_id
        self.limits = limits
        self.started = now
        self._workers: dict[bytes, WorkerEntry] = {}
        self._clients: dict[bytes, ClientEntry] = {}
        self._requests: dict[str, Req] = {}
        self._queues: dict[str, dict[str, Req]] = {}
        self._queued_bytes = 0  # sum of the bodies of queued requests
        self._idle: dict[str, dict[bytes, None]] = {}
        self._deadlines: list[tuple[float, str]] = []
        self._next_seq = 0
        self._rid_prefix = broker_id[:8] + "."
        self._heartbeat = protocol.Heartbeat(broker_id)
        self._next_heartbeat = now + limits.heartbeat_interval_s
        self._sweep_s = limits.heartbeat_interval_s / 4
        self._next_sweep = now + self._sweep_s
        self._disconnect_sent: dict[bytes, float] = {}
        # expired client -> (its open request ids, silence); oldest first, bounded
        # (request id, held by a worker at expiry)
        self._expired_clients: dict[bytes, tuple[list[tuple[str, bool]], float]] = {}
        self._expired_rids = 0
        self._now = now  # the latest time given to any entry point
        self.counters: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()

    # ------------------------------------------------------------------ input

    def on_client(self, identity: bytes, msg: protocol.Message, now: float) -> list[Send]:
        """A decoded message arrived on the frontend from client ``identity``."""
        out: list[Send] = []
        self._now = now
        client = self._clients.get(identity)
        if client is None:
            if isinstance(msg, protocol.Disconnect):
                entry = self._expired_clients.pop(identity, None)
                if entry is not None:
                    self._expired_rids -= len(entry[0])
                return out
            if len(self._clients) >= self.limits.max_clients:
                self.dropped["too_many_clients"] += 1
                if isinstance(msg, protocol.Request | protocol.Status):
                    self._fail_direct(identity, msg.request_id, FailureKind.OVERLOADED,
                                      "broker has too many clients", out)
                return out
            client = self._clients[identity] = ClientEntry(identity, now)
            # First contact: tell the client our id at once, so it notices a
            # broker restart without waiting for the next heartbeat round.
            out.append(Send(Side.CLIENT, identity, self._heartbeat))
            self._fail_expired(identity, out)
        client.last_seen = now
        if isinstance(msg, protocol.Request):
            self._on_request(client, msg.request_id, msg.service, msg.budget_s, msg.body,
                             msg.attempt, now, out)
        elif isinstance(msg, protocol.Heartbeat):
            if msg.peer_id != client.instance:
                if client.instance and msg.peer_id:
                    # Same identity, new process: the old one's requests are orphans.
                    self.counters["client_restarts"] += 1
                    self._remove_client(client, out)
                    client = self._clients[identity] = ClientEntry(identity, now)
                client.instance = msg.peer_id
        elif isinstance(msg, protocol.Cancel):
            self._on_cancel(client, msg.request_id, now, out)
        elif isinstance(msg, protocol.Status):
            body = protocol.pack(self.status(now))
            out.append(Send(Side.CLIENT, identity, protocol.Reply(msg.request_id, body)))
        elif isinstance(msg, protocol.Disconnect):
            self.counters["client_disconnects"] += 1
            self._remove_client(client, out)
        else:
            self.dropped["wrong_direction"] += 1
        return out

    def on_worker(self, identity: bytes, msg: protocol.Message, now: float) -> list[Send]:
        """A decoded message arrived on the backend from worker ``identity``."""
        out: list[Send] = []
        self._now = now
        worker = self._workers.get(identity)
        if isinstance(msg, protocol.Ready):
            if worker is not None:
                # A READY from a registered worker means it started afresh and
                # dropped whatever it held: its old requests are lost.
                self._remove_worker(worker, "re-registered", out)
            self._register(identity, msg, now, out)
            return out
        if worker is None:
            if isinstance(msg, protocol.Disconnect):
                return out
            self.dropped["unknown_worker"] += 1
            self._ask_to_register(identity, now, out)
            return out
        worker.last_seen = now
        if isinstance(msg, protocol.Reply):
            self._on_answer(worker, msg.request_id, msg.body, None, now, out)
        elif isinstance(msg, protocol.FailureReply):
            self._on_answer(worker, msg.request_id, msg.body, msg, now, out)
        elif isinstance(msg, protocol.Partial):
            req = worker.in_flight.get(msg.request_id)
            if req is None:
                self.dropped["unknown_request"] += 1
            elif req.closed:
                self.dropped["late_partial"] += 1
            else:
                self.counters["partials"] += 1
                out.append(Send(Side.CLIENT, req.client,
                                protocol.Partial(req.client_rid, msg.seq, msg.body)))
        elif isinstance(msg, protocol.Heartbeat):
            if msg.capacity is not None and msg.capacity != worker.capacity:
                self._set_capacity(worker, msg.capacity, now, out)
            self._recancel(worker, now, out)
        elif isinstance(msg, protocol.Disconnect):
            self.counters["worker_disconnects"] += 1
            self._remove_worker(worker, f"worker disconnected: {msg.reason}"[:200], out)
        else:
            self.dropped["wrong_direction"] += 1
        return out

    def on_request(self, identity: bytes, request_id: str, service: str, budget_s: float,
                   body: bytes, attempt: int, now: float) -> Forward | list[Send]:
        """``on_client`` with a REQUEST given as its fields: the broker's hot path.

        When the request goes straight to an idle worker (a known client, no queue
        for its service, nothing wrong with it), the state changes are the same
        and the one action is returned as a ``Forward``: send that worker
        ``Request(forward.request_id, service, forward.budget_s, body, attempt)``,
        with no message object built. Anything else goes through ``on_client``
        and returns its actions."""
        client = self._clients.get(identity)
        if (client is not None and budget_s > 0 and service not in self._queues
                and request_id not in client.pending
                and len(self._requests) < self.limits.max_requests):
            idle = self._idle.get(service)
            if idle:
                self._now = now
                client.last_seen = now
                self.counters["requests"] += 1
                # The body is not kept: the worker gets it now (see _dispatch).
                req = self._new_request(client, request_id, service, b"", attempt,
                                        now + budget_s)
                worker = self._workers[next(iter(idle))]
                return Forward(worker.identity, req.rid, self._assign(req, worker, now))
        return self.on_client(
            identity, protocol.Request(request_id, service, budget_s, body, attempt), now)

    def on_reply(self, identity: bytes, request_id: str, body: bytes,
                 now: float) -> Forward | list[Send]:
        """``on_worker`` with a REPLY given as its fields (see ``on_request``). When
        the answer goes to a waiting client and no queued work waits for the
        worker's free slot, returns ``Forward(client, client_request_id, 0.0)``:
        send that client ``Reply(forward.request_id, body)``."""
        worker = self._workers.get(identity)
        if worker is not None and not self._queues:
            req = worker.in_flight.get(request_id)
            if req is not None and not req.closed:
                self._now = now
                worker.last_seen = now
                self.counters["replies"] += 1
                self._close_answered(req)
                self._release(worker, req)
                self._mark_idle(worker)
                return Forward(req.client, req.client_rid, 0.0)
        return self.on_worker(identity, protocol.Reply(request_id, body), now)

    def drop(self, reason: str) -> None:
        """Count a frame the socket layer dropped before it reached the state machine."""
        self.dropped[reason] += 1

    def count(self, counter: str) -> None:
        """Count an event of the socket layer (e.g. an injected fault) in STATUS."""
        self.counters[counter] += 1

    # ------------------------------------------------------------------ timers

    def next_wakeup(self) -> float:
        """The monotonic time at which ``tick`` next has work to do."""
        wake = min(self._next_heartbeat, self._next_sweep)
        if self._deadlines and self._deadlines[0][0] < wake:
            wake = self._deadlines[0][0]
        return wake

    def tick(self, now: float) -> list[Send]:
        """Run the timers: heartbeats out, peer expiry, request budgets."""
        out: list[Send] = []
        self._now = now
        if now >= self._next_heartbeat:
            hb = self._heartbeat
            out.extend(Send(Side.WORKER, w, hb) for w in self._workers)
            out.extend(Send(Side.CLIENT, c, hb) for c in self._clients)
            self._next_heartbeat = now + self.limits.heartbeat_interval_s
        if now >= self._next_sweep:
            self._sweep(now, out)
            self._next_sweep = now + self._sweep_s
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            _, rid = heapq.heappop(deadlines)
            req = self._requests.get(rid)
            if req is not None and not req.closed:
                self._expire_request(req, out)
        if len(deadlines) > 1024 and len(deadlines) > 2 * len(self._requests):
            # Answered requests leave stale heap entries; rebuild to stay bounded.
            self._deadlines = [(r.deadline, r.rid) for r in self._requests.values()
                               if not r.closed]
            heapq.heapify(self._deadlines)
        return out

    def shutdown(self, reason: str) -> list[Send]:
        """Answer every open request and tell every worker to go; forget everything."""
        out: list[Send] = []
        for req in list(self._requests.values()):
            if not req.closed:  # no CANCEL: the DISCONNECT below drops all their work
                self._answer_failure(req, FailureKind.WORKER_LOST, reason, True, out,
                                     cancel_at_worker=False)
        out.extend(Send(Side.WORKER, w, protocol.Disconnect(reason)) for w in self._workers)
        self._requests.clear()
        self._queues.clear()
        self._queued_bytes = 0
        self._idle.clear()
        self._workers.clear()
        self._clients.clear()
        self._deadlines.clear()
        return out

    # ------------------------------------------------------------------ clients

    def _on_request(self, client: ClientEntry, request_id: str, service: str, budget_s: float,
                    body: bytes, attempt: int, now: float, out: list[Send]) -> None:
        self.counters["requests"] += 1
        cid = client.identity
        if request_id in client.pending:
            self.dropped["duplicate_request_id"] += 1
            return
        if budget_s <= 0:
            self._fail_direct(cid, request_id, FailureKind.TIMEOUT,
                              "request arrived with no budget left", out)
            return
        if len(self._requests) >= self.limits.max_requests:
            self._fail_direct(cid, request_id, FailureKind.OVERLOADED,
                              "broker is tracking too many requests", out)
            return
        if protocol.PINNED_SEP in service and not self._served(service):
            self._fail_direct(cid, request_id, FailureKind.UNROUTABLE,
                              f"no registered worker serves {service!r} (its worker is gone)",
                              out)
            return
        queue = self._queues.get(service)
        if queue is None:
            idle = self._idle.get(service)
            if idle:
                req = self._new_request(client, request_id, service, body, attempt,
                                        now + budget_s)
                self._dispatch(req, self._workers[next(iter(idle))], now, out)
                return
        if self._queued_bytes + len(body) > self.limits.max_queued_bytes:
            self._fail_direct(cid, request_id, FailureKind.OVERLOADED,
                              "queued request bodies are over the broker's byte bound", out)
            return
        if queue is None:
            if len(self._queues) >= self.limits.max_queued_services:
                self._fail_direct(cid, request_id, FailureKind.OVERLOADED,
                                  "too many services with queued requests", out)
                return
            queue = self._queues[service] = {}
        elif len(queue) >= self.limits.queue_limit:
            self._fail_direct(cid, request_id, FailureKind.OVERLOADED,
                              f"queue of service {service!r} is full", out)
            return
        req = self._new_request(client, request_id, service, body, attempt, now + budget_s)
        queue[req.rid] = req
        self._queued_bytes += len(body)

    def _served(self, service: str) -> bool:
        """Whether a registered worker offers ``service`` (O(workers), bounded)."""
        return any(service in w.services for w in self._workers.values())

    def _new_request(self, client: ClientEntry, client_rid: str, service: str, body: bytes,
                     attempt: int, deadline: float) -> Req:
        self._next_seq = seq = self._next_seq + 1
        rid = f"{self._rid_prefix}{seq:x}"
        req = Req(rid, seq, client.identity, client_rid, service, body, attempt, deadline)
        self._requests[rid] = req
        client.pending[client_rid] = req
        heapq.heappush(self._deadlines, (deadline, rid))
        return req

    def _on_cancel(self, client: ClientEntry, client_rid: str, now: float,
                   out: list[Send]) -> None:
        req = client.pending.get(client_rid)
        if req is None:
            self.dropped["cancel_unknown_request"] += 1
            return
        self.counters["cancels"] += 1
        self._answer_failure(req, FailureKind.CANCELLED, "cancelled by the client", False, out)

    def _remove_client(self, client: ClientEntry, out: list[Send]) -> None:
        del self._clients[client.identity]
        for req in list(client.pending.values()):
            self._close(req, out)
        client.pending.clear()

    def _remember_expired(self, client: ClientEntry, silent_s: float) -> None:
        """Keep the ids of an expired client's open requests, so that if it was
        only stalled (not dead) it learns they were dropped (``_fail_expired``)."""
        rids = [(rid, req.worker is not None) for rid, req in client.pending.items()]
        if not rids:
            return
        expired = self._expired_clients
        expired.pop(client.identity, None)
        expired[client.identity] = (rids, silent_s)
        self._expired_rids += len(rids)
        while expired and (len(expired) > self.limits.max_expired_clients
                           or self._expired_rids > self.limits.max_requests):
            oldest = next(iter(expired))
            self._expired_rids -= len(expired.pop(oldest)[0])
            self.dropped["expired_client_forgotten"] += 1

    def _fail_expired(self, identity: bytes, out: list[Send]) -> None:
        """A client the broker expired is back: answer each request it dropped
        then, retryable: ``worker_lost`` (effect unknown) for one a worker held,
        ``overloaded`` (never started) for one still queued. Without this a
        client whose loop stalled past the window would wait for them forever."""
        entry = self._expired_clients.pop(identity, None)
        if entry is None:
            return
        rids, silent_s = entry
        self._expired_rids -= len(rids)
        self.counters["expired_requests_failed"] += len(rids)
        why = f"the broker expired this client after {silent_s:.2f}s of silence"
        for rid, held in rids:
            if held:
                self._fail_direct(identity, rid, FailureKind.WORKER_LOST,
                                  f"{why} and cancelled the request at its worker; its "
                                  "effect is unknown", out)
            else:
                self._fail_direct(identity, rid, FailureKind.OVERLOADED,
                                  f"{why} and dropped the request from its queue; it never "
                                  "started", out)

    # ------------------------------------------------------------------ workers

    def _register(self, identity: bytes, msg: protocol.Ready, now: float,
                  out: list[Send]) -> None:
        if len(self._workers) >= self.limits.max_workers:
            self.dropped["too_many_workers"] += 1
            return
        worker = WorkerEntry(identity, tuple(dict.fromkeys(msg.services)), msg.capacity,
                         dict(msg.info), now)
        self._workers[identity] = worker
        self._disconnect_sent.pop(identity, None)
        self.counters["registrations"] += 1
        out.append(Send(Side.WORKER, identity, self._heartbeat))  # acknowledges READY
        self._fill(worker, now, out)

    def _set_capacity(self, worker: WorkerEntry, capacity: int, now: float,
                      out: list[Send]) -> None:
        """A worker that serves several brokers moved slots (HEARTBEAT ``capacity``):
        lowered, it takes no new work until its held requests fit; raised, it
        takes queued work at once. Held requests are never touched."""
        self.counters["capacity_updates"] += 1
        if capacity < worker.capacity:
            worker.lowered = True
        worker.capacity = capacity
        if len(worker.in_flight) >= capacity:
            wid = worker.identity
            for service in worker.services:
                idle = self._idle.get(service)
                if idle is not None:
                    idle.pop(wid, None)
                    if not idle:
                        del self._idle[service]
        elif self._queues:
            self._fill(worker, now, out)
        else:
            self._mark_idle(worker)

    def _ask_to_register(self, identity: bytes, now: float, out: list[Send]) -> None:
        last = self._disconnect_sent.get(identity)
        if last is not None and now - last < self.limits.heartbeat_interval_s:
            return
        if len(self._disconnect_sent) >= 4096:
            self._disconnect_sent.clear()
        self._disconnect_sent[identity] = now
        out.append(Send(Side.WORKER, identity, protocol.Disconnect("unknown worker: send READY")))

    def _on_answer(self, worker: WorkerEntry, request_id: str, body: bytes,
                   failure: protocol.FailureReply | None, now: float, out: list[Send]) -> None:
        """A REPLY (``failure`` is None) or a FAILURE for ``request_id`` from ``worker``."""
        req = worker.in_flight.get(request_id)
        if req is None:
            self.dropped["unknown_request"] += 1
            return
        if req.closed:
            self.dropped["late_answer"] += 1
        else:
            self._close_answered(req)
            if failure is None:
                self.counters["replies"] += 1
                answer: protocol.Message = protocol.Reply(req.client_rid, body)
            else:
                self.failures[failure.kind] += 1
                answer = protocol.FailureReply(req.client_rid, failure.kind, failure.message,
                                               failure.retryable, body)
            out.append(Send(Side.CLIENT, req.client, answer))
        self._release(worker, req)
        if self._queues:
            self._fill(worker, now, out)
        else:
            self._mark_idle(worker)

    def _close_answered(self, req: Req) -> None:
        """The client gets its final answer now: the request is no longer pending."""
        client = self._clients.get(req.client)
        if client is not None:
            del client.pending[req.client_rid]
        req.closed = True

    def _release(self, worker: WorkerEntry, req: Req) -> None:
        """``worker`` answered ``req``: forget the request and free its slot."""
        worker.answered += 1
        del worker.in_flight[req.rid]
        del self._requests[req.rid]

    def _recancel(self, worker: WorkerEntry, now: float, out: list[Send]) -> None:
        """Repeat the CANCEL of a request whose answer has not come back within a
        liveness window: a CANCEL or its answer may have been lost, and only an
        answer frees the slot. Runs on the worker's heartbeat; bounded by capacity."""
        window = self.limits.window_s
        for req in worker.in_flight.values():
            if req.closed and now - req.cancel_at >= window:
                req.cancel_at = now
                self.counters["cancel_resends"] += 1
                out.append(Send(Side.WORKER, worker.identity, protocol.Cancel(req.rid)))

    def _remove_worker(self, worker: WorkerEntry, reason: str, out: list[Send]) -> None:
        del self._workers[worker.identity]
        for service in worker.services:
            idle = self._idle.get(service)
            if idle is not None:
                idle.pop(worker.identity, None)
                if not idle:
                    del self._idle[service]
        for req in worker.in_flight.values():
            if plants.on("lost_call_as_timeout"):  # chaos plant: left to its deadline
                continue
            if not req.closed:
                self._answer_failure(req, FailureKind.WORKER_LOST, reason, True, out,
                                     cancel_at_worker=False)
            del self._requests[req.rid]
        worker.in_flight.clear()

    def _dispatch(self, req: Req, worker: WorkerEntry, now: float, out: list[Send]) -> None:
        """Give the queued-or-new ``req`` to ``worker``, which has a free slot."""
        budget = self._assign(req, worker, now)
        body, req.body = req.body, b""  # the worker has it now; do not keep a copy
        out.append(Send(Side.WORKER, worker.identity, protocol.Request(
            req.rid, req.service, budget, body, req.attempt)))

    def _assign(self, req: Req, worker: WorkerEntry, now: float) -> float:
        """Record ``req`` as held by ``worker`` (which has a free slot); return the
        budget left to forward with it."""
        wid = req.worker = worker.identity
        in_flight = worker.in_flight
        in_flight[req.rid] = req
        full = len(in_flight) >= worker.capacity
        idle_sets = self._idle
        for service in worker.services:
            idle = idle_sets.get(service)
            if idle is None:
                continue
            idle.pop(wid, None)
            if not full:
                idle[wid] = None  # most recently used goes to the end
            elif not idle:
                del idle_sets[service]
        budget = req.deadline - now
        return budget if budget > 0 else 0.0

    def _fill(self, worker: WorkerEntry, now: float, out: list[Send]) -> None:
        """Hand queued work to ``worker`` while it has free slots; else mark it idle."""
        while len(worker.in_flight) < worker.capacity:
            best: dict[str, Req] | None = None
            best_req: Req | None = None
            for service in worker.services:
                queue = self._queues.get(service)
                if queue:
                    head = next(iter(queue.values()))
                    if best_req is None or head.seq < best_req.seq:
                        best, best_req = queue, head
            if best is None or best_req is None:
                break
            del best[best_req.rid]
            self._queued_bytes -= len(best_req.body)
            if not best:
                del self._queues[best_req.service]
            self._dispatch(best_req, worker, now, out)
        self._mark_idle(worker)

    def _mark_idle(self, worker: WorkerEntry) -> None:
        """If ``worker`` has a free slot, make it the most recently used idle worker
        of each of its services."""
        if len(worker.in_flight) < worker.capacity:
            wid = worker.identity
            idle_sets = self._idle
            for service in worker.services:
                idle = idle_sets.get(service)
                if idle is None:
                    idle_sets[service] = {wid: None}
                else:
                    idle.pop(wid, None)
                    idle[wid] = None

    # ------------------------------------------------------------------ answers

    def _fail_direct(self, identity: bytes, client_rid: str, kind: str, message: str,
                     out: list[Send]) -> None:
        """Answer a request the broker never tracked."""
        self.failures[kind] += 1
        retryable = kind in (FailureKind.OVERLOADED, FailureKind.TIMEOUT,
                             FailureKind.WORKER_LOST, FailureKind.UNROUTABLE)
        out.append(Send(Side.CLIENT, identity,
                        protocol.FailureReply(client_rid, kind, message, retryable)))

    def _answer_failure(self, req: Req, kind: str, message: str, retryable: bool,
                        out: list[Send], *, cancel_at_worker: bool = True) -> None:
        """Send the final FAILURE for an open request and close it."""
        self.failures[kind] += 1
        out.append(Send(Side.CLIENT, req.client,
                        protocol.FailureReply(req.client_rid, kind, message, retryable)))
        client = self._clients.get(req.client)
        if client is not None:
            client.pending.pop(req.client_rid, None)
        if cancel_at_worker:
            self._close(req, out)
        else:
            req.closed = True  # the caller is dropping the worker that holds it

    def _close(self, req: Req, out: list[Send]) -> None:
        """No more messages go to the client. A held request keeps its slot and is
        cancelled at its worker; a queued one is forgotten."""
        req.closed = True
        if req.worker is None:
            queue = self._queues.get(req.service)
            if queue is not None and queue.pop(req.rid, None) is not None:
                self._queued_bytes -= len(req.body)
                if not queue:
                    del self._queues[req.service]
            del self._requests[req.rid]
        else:
            req.cancel_at = self._now
            out.append(Send(Side.WORKER, req.worker, protocol.Cancel(req.rid)))

    def _expire_request(self, req: Req, out: list[Send]) -> None:
        where = "in the queue" if req.worker is None else "at the worker"
        self._answer_failure(req, FailureKind.TIMEOUT, f"budget ran out {where}", True, out)

    def _sweep(self, now: float, out: list[Send]) -> None:
        cutoff = now - self.limits.window_s
        for worker in [w for w in self._workers.values() if w.last_seen < cutoff]:
            self.counters["worker_expiries"] += 1
            silent = now - worker.last_seen
            self._remove_worker(worker, f"worker silent for {silent:.2f}s", out)
        cutoff = now - self.limits.client_window_s
        for client in [c for c in self._clients.values() if c.last_seen < cutoff]:
            self.counters["client_expiries"] += 1
            self._remember_expired(client, now - client.last_seen)
            self._remove_client(client, out)

    # ------------------------------------------------------------------ views

    def status(self, now: float) -> dict[str, Any]:
        """The STATUS answer (documented in docs/protocol.md)."""
        per_service: dict[str, dict[str, Any]] = {}
        for worker in self._workers.values():
            busy = len(worker.in_flight) >= worker.capacity
            entry = {
                "identity": peer_name(worker.identity),
                "services": list(worker.services),
                "capacity": worker.capacity,
                "in_flight": len(worker.in_flight),
                # Which services the held requests are for (chaos targets a
                # worker by what it is doing: model stream, tool or idle).
                "in_flight_services": sorted(r.service for r in worker.in_flight.values()),
                "answered": worker.answered,
                "last_seen_s": round(now - worker.last_seen, 4),
                "info": worker.info,
            }
            for service in worker.services:
                svc = per_service.setdefault(service, {"idle": 0, "busy": 0, "workers": []})
                svc["busy" if busy else "idle"] += 1
                svc["workers"].append(entry)
        clients = [
            {"identity": peer_name(c.identity), "pending": len(c.pending),
             "last_seen_s": round(now - c.last_seen, 4)}
            for c in list(self._clients.values())[:MAX_STATUS_CLIENTS]
        ]
        return {
            "broker_id": self.broker_id,
            "uptime_s": round(now - self.started, 3),
            "heartbeat_interval_s": self.limits.heartbeat_interval_s,
            "liveness": self.limits.liveness,
            "workers": per_service,
            "worker_count": len(self._workers),
            "queues": {s: len(q) for s, q in self._queues.items()},
            "client_count": len(self._clients),
            "clients": clients,
            "requests_tracked": len(self._requests),
            "queued_bytes": self._queued_bytes,
            "counters": {
                **{k: self.counters[k] for k in (
                    "requests", "replies", "partials", "cancels", "registrations",
                    "worker_expiries", "client_expiries", "worker_disconnects",
                    "client_disconnects", "client_restarts", "cancel_resends",
                    "expired_requests_failed", "capacity_updates")},
                "failures": dict(self.failures),
                "dropped": dict(self.dropped),
                "faults": {k.removeprefix("fault_"): v for k, v in self.counters.items()
                           if k.startswith("fault_")},
            },
        }

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` if the bookkeeping is inconsistent (for tests)."""
        def fail(why: str) -> None:
            raise RuntimeError(f"dispatcher invariant broken: {why}")

        held: set[str] = set()
        for worker in self._workers.values():
            if len(worker.in_flight) > worker.capacity and not worker.lowered:
                # Only a worker's own HEARTBEAT capacity may leave it over: the
                # dispatcher never assigns past a worker's capacity.
                fail(f"worker {worker.identity!r} over capacity")
            for rid, req in worker.in_flight.items():
                if req.worker != worker.identity or self._requests.get(rid) is not req:
                    fail(f"held request {rid} not tracked consistently")
                held.add(rid)
            free = len(worker.in_flight) < worker.capacity
            for service in worker.services:
                if free != (worker.identity in self._idle.get(service, {})):
                    fail(f"idle set of {service!r} wrong for {worker.identity!r}")
        queued: set[str] = set()
        for service, queue in self._queues.items():
            if not queue:
                fail(f"empty queue kept for {service!r}")
            for rid, req in queue.items():
                if req.worker is not None or req.closed or req.service != service:
                    fail(f"queued request {rid} in a wrong state")
                queued.add(rid)
        queued_bytes = sum(len(r.body) for q in self._queues.values() for r in q.values())
        if queued_bytes != self._queued_bytes:
            fail(f"queued bytes {self._queued_bytes} != {queued_bytes}")
        if held & queued or held | queued != set(self._requests):
            fail("requests are not exactly queued or held")
        for service in self._queues:
            if self._idle.get(service):
                fail(f"requests of {service!r} queued while a worker is idle")
        for service, idle in self._idle.items():
            for wid in idle:
                if wid not in self._workers:
                    fail(f"dead worker {wid!r} idle for {service!r}")
        for client in self._clients.values():
            for crid, req in client.pending.items():
                if req.closed or req.client_rid != crid or self._requests.get(req.rid) is not req:
                    fail(f"pending request {crid} of a client is not open")
        open_reqs = [r for r in self._requests.values() if not r.closed]
        if sum(len(c.pending) for c in self._clients.values()) != len(open_reqs):
            fail("open requests and client pending maps disagree")
        if self._expired_rids != sum(len(r) for r, _ in self._expired_clients.values()):
            fail("the count of remembered expired requests is wrong")
        if len(self._expired_clients) > self.limits.max_expired_clients:
            fail("too many expired clients remembered")

    def registered_workers(self) -> set[bytes]:
        return set(self._workers)

    def registered_clients(self) -> set[bytes]:
        return set(self._clients)

    def held_by(self, worker: bytes) -> set[str]:
        """Broker request ids held by ``worker`` (answered-but-unacknowledged included)."""
        w = self._workers.get(worker)
        return set(w.in_flight) if w is not None else set()

    def open_requests(self) -> Iterable[tuple[bytes, str]]:
        """(client identity, client request id) of every request not yet answered."""
        return [(r.client, r.client_rid) for r in self._requests.values() if not r.closed]
