"""Deterministic unit tests of the pure dispatch state machine (no sockets)."""

from __future__ import annotations

from broker import protocol
from broker.state import Dispatcher, Limits, Send, Side

LIMITS = Limits(heartbeat_interval_s=0.25, liveness=4, client_liveness=4, queue_limit=2,
                max_requests=5)


def new(now: float = 0.0) -> Dispatcher:
    return Dispatcher("0123456789abcdef", LIMITS, now)


def requests_to(actions: list[Send]) -> list[tuple[bytes, protocol.Request]]:
    return [(a.identity, a.msg) for a in actions
            if a.side is Side.WORKER and isinstance(a.msg, protocol.Request)]


def client_msgs(actions: list[Send]) -> list[protocol.Message]:
    return [a.msg for a in actions if a.side is Side.CLIENT
            and not isinstance(a.msg, protocol.Heartbeat)]


def test_least_recently_used_idle_worker_gets_the_request() -> None:
    d = new()
    for w in (b"w1", b"w2", b"w3"):
        d.on_worker(w, protocol.Ready(("s",), 1), 0.0)
    got = []
    for i in range(3):
        out = d.on_client(b"c", protocol.Request(f"r{i}", "s", 5.0), 0.0)
        got += [w for w, _ in requests_to(out)]
    assert got == [b"w1", b"w2", b"w3"]
    # w2 answers first, then w1: the next requests go to w2, then w1 (LRU order).
    (rid2,) = d.held_by(b"w2")
    (rid1,) = d.held_by(b"w1")
    d.on_worker(b"w2", protocol.Reply(rid2), 0.1)
    d.on_worker(b"w1", protocol.Reply(rid1), 0.2)
    out = d.on_client(b"c", protocol.Request("r3", "s", 5.0), 0.3)
    assert [w for w, _ in requests_to(out)] == [b"w2"]
    d.check_invariants()


def test_capacity_is_respected_and_forwarded_budget_is_the_remainder() -> None:
    d = new()
    d.on_worker(b"w", protocol.Ready(("s",), 2), 0.0)
    out = d.on_client(b"c", protocol.Request("a", "s", 5.0), 1.0)
    out += d.on_client(b"c", protocol.Request("b", "s", 5.0), 1.0)
    out += d.on_client(b"c", protocol.Request("q", "s", 5.0), 1.0)
    assert len(requests_to(out)) == 2
    assert d.status(1.0)["queues"] == {"s": 1}
    rid = sorted(d.held_by(b"w"))[0]
    out = d.on_worker(b"w", protocol.Reply(rid, b"ok"), 3.0)
    ((_, forwarded),) = requests_to(out)
    assert forwarded.body == b""
    assert abs(forwarded.budget_s - 3.0) < 1e-9  # 5 s budget, 2 s spent queued
    d.check_invariants()


def test_oldest_queued_request_across_services_goes_first() -> None:
    d = new()
    d.on_client(b"c", protocol.Request("old", "b", 5.0), 0.0)
    d.on_client(b"c", protocol.Request("new", "a", 5.0), 0.1)
    out = d.on_worker(b"w", protocol.Ready(("a", "b"), 1), 0.2)
    ((_, first),) = requests_to(out)
    assert first.service == "b"


def test_bounds_answer_overloaded() -> None:
    d = new()
    out: list[Send] = []
    for i in range(3):  # queue_limit=2
        out += d.on_client(b"c", protocol.Request(f"r{i}", "s", 5.0), 0.0)
    (failure,) = client_msgs(out)
    assert isinstance(failure, protocol.FailureReply)
    assert (failure.request_id, failure.kind, failure.retryable) == ("r2", "overloaded", True)
    for i in range(3, 7):  # max_requests=5 over all services: r3..r5 fit, r6 does not
        out = d.on_client(b"c", protocol.Request(f"r{i}", f"t{i}", 5.0), 0.0)
    (failure,) = client_msgs(out)
    assert isinstance(failure, protocol.FailureReply)
    assert failure.kind == "overloaded"
    d.check_invariants()


def test_duplicate_open_request_id_is_dropped_and_zero_budget_times_out() -> None:
    d = new()
    d.on_client(b"c", protocol.Request("r", "s", 5.0), 0.0)
    assert d.on_client(b"c", protocol.Request("r", "s", 5.0), 0.0) == []
    assert d.dropped["duplicate_request_id"] == 1
    (failure,) = client_msgs(d.on_client(b"c", protocol.Request("z", "s", 0.0), 0.0))
    assert isinstance(failure, protocol.FailureReply)
    assert failure.kind == "timeout"


def test_expired_busy_worker_fails_its_requests_and_timers_heartbeat() -> None:
    d = new()
    d.on_worker(b"w", protocol.Ready(("s",), 1), 0.0)
    d.on_client(b"c", protocol.Request("r", "s", 60.0), 0.0)
    out = d.tick(0.25)
    beats = {(a.side, a.identity) for a in out if isinstance(a.msg, protocol.Heartbeat)}
    assert beats == {(Side.WORKER, b"w"), (Side.CLIENT, b"c")}
    d.on_client(b"c", protocol.Heartbeat("c"), 0.9)
    out = []
    now = 0.25
    while now < 1.2:  # the worker went silent at 0.0; the window is 1.0 s
        now = d.next_wakeup()
        out += d.tick(now)
    (failure,) = client_msgs(out)
    assert isinstance(failure, protocol.FailureReply)
    assert (failure.request_id, failure.kind, failure.retryable) == ("r", "worker_lost", True)
    assert d.registered_workers() == set()
    # No CANCEL is sent to the worker that was dropped.
    assert not [a for a in out if isinstance(a.msg, protocol.Cancel)]
    assert d.counters["worker_expiries"] == 1
    d.check_invariants()


def test_stale_deadline_entries_are_compacted() -> None:
    d = Dispatcher("0123456789abcdef", Limits(max_requests=10_000), 0.0)
    d.on_worker(b"w", protocol.Ready(("s",), 1), 0.0)
    for i in range(3000):
        d.on_client(b"c", protocol.Request(f"r{i}", "s", 600.0), 0.0)
        (rid,) = d.held_by(b"w")
        d.on_worker(b"w", protocol.Reply(rid), 0.0)
        d.on_client(b"c", protocol.Heartbeat("c"), 0.0)
        d.on_worker(b"w", protocol.Heartbeat("w"), 0.0)
    d.tick(0.0)
    assert len(d._deadlines) <= 1024


def test_shutdown_answers_everything_and_disconnects_workers() -> None:
    d = new()
    d.on_worker(b"w", protocol.Ready(("s",), 1), 0.0)
    d.on_client(b"c", protocol.Request("held", "s", 5.0), 0.0)
    d.on_client(b"c", protocol.Request("queued", "s", 5.0), 0.0)
    out = d.shutdown("broker shutting down")
    failures = {m.request_id: m.kind for m in client_msgs(out)
                if isinstance(m, protocol.FailureReply)}
    assert failures == {"held": "worker_lost", "queued": "worker_lost"}
    assert [(a.identity, type(a.msg)) for a in out if a.side is Side.WORKER] == [
        (b"w", protocol.Disconnect)]


def test_restarted_client_with_same_identity_orphans_the_old_requests() -> None:
    d = new()
    d.on_worker(b"w", protocol.Ready(("s",), 1), 0.0)
    d.on_client(b"c", protocol.Heartbeat("first-process"), 0.0)
    d.on_client(b"c", protocol.Request("1", "s", 5.0), 0.0)
    d.on_client(b"c", protocol.Request("2", "s", 5.0), 0.0)
    out = d.on_client(b"c", protocol.Heartbeat("second-process"), 0.1)
    # The held request is cancelled at its worker, the queued one dropped; the new
    # process gets no answers for ids it never sent.
    (rid,) = d.held_by(b"w")
    assert [(a.identity, a.msg) for a in out] == [(b"w", protocol.Cancel(rid))]
    assert list(d.open_requests()) == []
    assert d.counters["client_restarts"] == 1
    d.on_client(b"c", protocol.Request("1", "s", 5.0), 0.2)  # id reuse is fine now
    assert d.status(0.2)["queues"] == {"s": 1}
    d.check_invariants()


def test_unanswered_cancel_is_repeated_each_liveness_window() -> None:
    d = new()
    d.on_worker(b"w", protocol.Ready(("s",), 1), 0.0)
    d.on_client(b"c", protocol.Request("r", "s", 60.0), 0.0)
    out = d.on_client(b"c", protocol.Cancel("r"), 0.1)
    (rid,) = d.held_by(b"w")
    assert [a.msg for a in out if a.side is Side.WORKER] == [protocol.Cancel(rid)]
    # The CANCEL (or its answer) was lost: the slot stays held, and the CANCEL is
    # sent again with a heartbeat once a liveness window (1 s) has passed.
    assert d.on_worker(b"w", protocol.Heartbeat("w"), 0.6) == []
    out = d.on_worker(b"w", protocol.Heartbeat("w"), 1.2)
    assert [a.msg for a in out] == [protocol.Cancel(rid)]
    assert d.on_worker(b"w", protocol.Heartbeat("w"), 1.5) == []
    d.on_worker(b"w", protocol.FailureReply(rid, "cancelled", "", False), 1.6)
    assert d.held_by(b"w") == set()
    assert d.counters["cancel_resends"] == 1
    d.check_invariants()


def test_queued_bodies_are_bounded_in_bytes_and_not_kept_after_dispatch() -> None:
    d = Dispatcher("0123456789abcdef", Limits(max_queued_bytes=1000), 0.0)
    d.on_client(b"c", protocol.Request("a", "s", 5.0, b"x" * 600), 0.0)
    (failure,) = client_msgs(d.on_client(b"c", protocol.Request("b", "s", 5.0, b"y" * 600),
                                         0.0))
    assert isinstance(failure, protocol.FailureReply)
    assert failure.kind == "overloaded"
    assert d.status(0.0)["queued_bytes"] == 600
    out = d.on_worker(b"w", protocol.Ready(("s",), 1), 0.1)
    ((_, request),) = requests_to(out)
    assert request.body == b"x" * 600
    assert d.status(0.1)["queued_bytes"] == 0
    d.on_client(b"c", protocol.Request("b", "s", 5.0, b"y" * 600), 0.2)  # fits again
    d.check_invariants()


def test_a_stalled_client_that_comes_back_learns_its_expired_requests_failed() -> None:
    d = new()
    d.on_worker(b"w", protocol.Ready(("s",), 1), 0.0)
    d.on_client(b"c", protocol.Heartbeat("proc"), 0.0)
    d.on_client(b"c", protocol.Request("held", "s", 60.0), 0.0)
    d.on_client(b"c", protocol.Request("queued", "s", 60.0), 0.0)
    (rid,) = d.held_by(b"w")
    out: list[Send] = []
    now = 0.0
    while now < 1.2:  # the client's loop stalls past the 1 s window; the worker beats on
        now = d.next_wakeup()
        d.on_worker(b"w", protocol.Heartbeat("w"), now)
        out += d.tick(now)
    assert d.counters["client_expiries"] == 1
    # Expiry cancels the held request at its worker and says nothing to the (silent) client.
    assert [a.msg for a in out if a.side is Side.WORKER and
            isinstance(a.msg, protocol.Cancel)] == [protocol.Cancel(rid)]
    assert client_msgs(out) == []
    # The client's loop resumes: its next message brings a FAILURE for each
    # request the broker dropped, so none waits forever.
    back = d.on_client(b"c", protocol.Heartbeat("proc"), 1.5)
    failures = {m.request_id: (m.kind, m.retryable) for m in client_msgs(back)
                if isinstance(m, protocol.FailureReply)}
    # held: the effect is unknown; queued: it never started
    assert failures == {"held": ("worker_lost", True), "queued": ("overloaded", True)}
    assert d.counters["expired_requests_failed"] == 2
    # Only once: the next message brings nothing more.
    assert client_msgs(d.on_client(b"c", protocol.Heartbeat("proc"), 1.6)) == []
    d.check_invariants()


def test_remembered_expired_clients_are_bounded() -> None:
    limits = Limits(heartbeat_interval_s=0.25, liveness=4, client_liveness=4,
                    max_expired_clients=3)
    d = Dispatcher("0123456789abcdef", limits, 0.0)
    for i in range(5):
        d.on_client(f"c{i}".encode(), protocol.Request("r", "s", 60.0), 0.0)
    now = 0.0
    while now < 1.2:
        now = d.next_wakeup()
        d.tick(now)
    assert d.counters["client_expiries"] == 5
    assert d.dropped["expired_client_forgotten"] == 2
    d.check_invariants()
    answered = [i for i in range(5)
                if client_msgs(d.on_client(f"c{i}".encode(), protocol.Heartbeat("x"), 1.5))]
    assert answered == [2, 3, 4]  # the oldest two were forgotten (their calls time out locally)
    d.check_invariants()


def test_a_client_is_given_a_longer_window_than_a_worker_by_default() -> None:
    d = Dispatcher("0123456789abcdef", Limits(heartbeat_interval_s=0.25, liveness=4), 0.0)
    d.on_worker(b"w", protocol.Ready(("s",), 1), 0.0)
    d.on_client(b"c", protocol.Request("r", "s", 60.0), 0.0)
    now = 0.0
    while now < 9.0:  # both silent; the worker's window is 1 s, the client's 10 s
        now = d.next_wakeup()
        d.tick(now)
    assert (d.counters["worker_expiries"], d.counters["client_expiries"]) == (1, 0)
    while now < 10.2:
        now = d.next_wakeup()
        d.tick(now)
    assert d.counters["client_expiries"] == 1
    d.check_invariants()
