"""The pure dispatch state machine under random steps (Hypothesis RuleBasedStateMachine).

Invariant: every request is queued, in flight on exactly one live worker, or
answered exactly once (or dropped because its client left), whatever happens:
register, request, reply, failure, partial, cancel, expire, disconnect,
re-register, heartbeats and time advancing.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from broker import protocol
from broker.state import Dispatcher, Limits, Send, Side

WORKERS = [b"w1", b"w2", b"w3"]
CLIENTS = [b"c1", b"c2"]
SERVICES = ["a", "b", "c"]
LIMITS = Limits(heartbeat_interval_s=0.25, liveness=4, client_liveness=6, queue_limit=3,
                max_requests=12)


class DispatcherMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.now = 1000.0
        self.d = Dispatcher("b" * 16, LIMITS, self.now)
        self.next_id = 0
        # model of what the peers saw
        self.answers: Counter[tuple[bytes, str]] = Counter()
        self.sent: set[tuple[bytes, str]] = set()
        self.gone: set[tuple[bytes, str]] = set()  # requests whose client left
        self.held: dict[bytes, set[str]] = {}  # worker -> request ids it was given
        self.cancelled: set[tuple[bytes, str]] = set()  # (worker, rid) CANCELs received
        self.instances: dict[bytes, str] = {}  # last non-empty instance id per live client
        self.caps: dict[bytes, int] = {}  # worker -> the capacity it last said

    # ------------------------------------------------------------ helpers

    def apply(self, actions: list[Send]) -> None:
        for a in actions:
            msg = a.msg
            if a.side is Side.CLIENT:
                if isinstance(msg, protocol.Reply | protocol.FailureReply):
                    key = (a.identity, msg.request_id)
                    if msg.request_id.startswith("s"):
                        continue  # a STATUS answer
                    assert key in self.sent, f"answer for a request never sent: {key}"
                    self.answers[key] += 1
                elif isinstance(msg, protocol.Partial):
                    assert (a.identity, msg.request_id) in self.sent
                    assert self.answers[(a.identity, msg.request_id)] == 0, "partial after answer"
            else:
                if isinstance(msg, protocol.Request):
                    held = self.held.setdefault(a.identity, set())
                    assert msg.request_id not in held, "request dispatched twice"
                    assert len(held) < self.caps[a.identity], "dispatched past its capacity"
                    held.add(msg.request_id)
                    assert msg.budget_s >= 0
                elif isinstance(msg, protocol.Cancel):
                    assert msg.request_id in self.held.get(a.identity, set()), \
                        "CANCEL for a request the worker does not hold"
                    self.cancelled.add((a.identity, msg.request_id))
        # Workers the dispatcher forgot drop everything they held, as real ones do.
        live = self.d.registered_workers()
        for w in list(self.held):
            if w not in live:
                del self.held[w]
        clients = self.d.registered_clients()
        for c in list(self.instances):
            if c not in clients:
                del self.instances[c]

    def client_left(self, client: bytes) -> None:
        for key in self.sent:
            if key[0] == client and self.answers[key] == 0:
                self.gone.add(key)

    # ------------------------------------------------------------ rules

    @rule(worker=st.sampled_from(WORKERS),
          services=st.lists(st.sampled_from(SERVICES), min_size=1, max_size=3),
          capacity=st.integers(1, 3))
    def register(self, worker: bytes, services: list[str], capacity: int) -> None:
        self.held.pop(worker, None)  # a (re-)registering worker starts afresh
        self.caps[worker] = capacity
        self.apply(self.d.on_worker(worker, protocol.Ready(tuple(services), capacity), self.now))

    @rule(client=st.sampled_from(CLIENTS), service=st.sampled_from(SERVICES),
          budget=st.sampled_from([0.0, 0.1, 0.5, 2.0, 30.0]))
    def request(self, client: bytes, service: str, budget: float) -> None:
        self.next_id += 1
        rid = f"r{self.next_id}"
        self.sent.add((client, rid))
        self.gone.discard((client, rid))
        msg = protocol.Request(rid, service, budget, b"body")
        self.apply(self.d.on_client(client, msg, self.now))

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data(), kind=st.sampled_from(["reply", "failure", "partial", "twice"]))
    def worker_answers(self, data: st.DataObject, kind: str) -> None:
        worker = data.draw(st.sampled_from(sorted(w for w, h in self.held.items() if h)))
        rid = data.draw(st.sampled_from(sorted(self.held[worker])))
        if kind == "partial":
            self.apply(self.d.on_worker(worker, protocol.Partial(rid, 0, b"p"), self.now))
            return
        self.held[worker].discard(rid)
        msg: protocol.Message = (protocol.Reply(rid, b"ok") if kind != "failure"
                                 else protocol.FailureReply(rid, "bad_request", "no", False))
        self.apply(self.d.on_worker(worker, msg, self.now))
        if kind == "twice":
            self.apply(self.d.on_worker(worker, msg, self.now))

    @rule(worker=st.sampled_from(WORKERS), rid=st.sampled_from(["nope", "bbbbbbbb.1"]))
    def unknown_answer(self, worker: bytes, rid: str) -> None:
        if rid in self.held.get(worker, set()):
            return
        self.apply(self.d.on_worker(worker, protocol.Reply(rid, b"?"), self.now))

    @precondition(lambda self: bool(self.sent))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        client, rid = data.draw(st.sampled_from(sorted(self.sent)))
        self.apply(self.d.on_client(client, protocol.Cancel(rid), self.now))

    @rule(worker=st.sampled_from(WORKERS))
    def worker_disconnects(self, worker: bytes) -> None:
        self.apply(self.d.on_worker(worker, protocol.Disconnect("bye"), self.now))

    @rule(client=st.sampled_from(CLIENTS))
    def client_disconnects(self, client: bytes) -> None:
        self.client_left(client)
        self.apply(self.d.on_client(client, protocol.Disconnect("bye"), self.now))

    @rule(worker=st.sampled_from(WORKERS))
    def worker_heartbeat(self, worker: bytes) -> None:
        self.apply(self.d.on_worker(worker, protocol.Heartbeat("w"), self.now))

    @rule(worker=st.sampled_from(WORKERS), capacity=st.integers(0, 3))
    def worker_moves_slots(self, worker: bytes, capacity: int) -> None:
        """A worker serving several brokers changes its capacity here (HEARTBEAT c)."""
        if worker in self.d.registered_workers():
            self.caps[worker] = capacity
        self.apply(self.d.on_worker(worker, protocol.Heartbeat("w", capacity), self.now))

    @rule(client=st.sampled_from(CLIENTS), instance=st.sampled_from(["", "p1", "p2"]))
    def client_heartbeat(self, client: bytes, instance: str) -> None:
        # A new non-empty instance id from a known client means it restarted.
        known = client in self.d.registered_clients()
        if known and instance and self.instances.get(client, instance) != instance:
            self.client_left(client)
        self.apply(self.d.on_client(client, protocol.Heartbeat(instance), self.now))
        if instance:
            self.instances[client] = instance

    @rule(client=st.sampled_from(CLIENTS))
    def status(self, client: bytes) -> None:
        self.next_id += 1
        self.apply(self.d.on_client(client, protocol.Status(f"s{self.next_id}"), self.now))

    @rule(dt=st.sampled_from([0.01, 0.1, 0.3, 0.9, 1.2, 5.0]))
    def time_passes(self, dt: float) -> None:
        before = self.d.registered_clients()
        self.now += dt
        while self.d.next_wakeup() <= self.now:
            self.apply(self.d.tick(self.d.next_wakeup()))
        self.apply(self.d.tick(self.now))
        for client in before - self.d.registered_clients():
            self.client_left(client)

    # ------------------------------------------------------------ invariants

    @invariant()
    def bookkeeping_is_consistent(self) -> None:
        self.d.check_invariants()

    @invariant()
    def every_request_queued_in_flight_or_answered_once(self) -> None:
        open_reqs = set(self.d.open_requests())
        for key in self.sent:
            answers = self.answers[key]
            assert answers <= 1, f"{key} answered {answers} times"
            if key in open_reqs:
                assert answers == 0, f"{key} answered but still open"
            else:
                assert answers == 1 or key in self.gone, f"{key} neither open nor answered"

    @invariant()
    def workers_hold_exactly_what_they_were_given(self) -> None:
        for worker, held in self.held.items():
            assert self.d.held_by(worker) == held


DispatcherMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60,
                                               deadline=None)
TestDispatcher = DispatcherMachine.TestCase
