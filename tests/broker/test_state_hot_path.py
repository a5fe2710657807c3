"""The dispatcher's hot path (``on_request``/``on_reply``, which may answer with a
``Forward``) has exactly the effect of the general path (``on_client``/``on_worker``
with the message): two dispatchers fed the same random steps, one through each,
send the same messages and report the same STATUS after every step."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from broker import protocol
from broker.state import Dispatcher, Forward, Limits, Send, Side

LIMITS = Limits(heartbeat_interval_s=0.25, liveness=4, client_liveness=8, queue_limit=2,
                max_requests=6)
WORKERS = [b"w1", b"w2"]
CLIENTS = [b"c1", b"c2"]
SERVICES = ["a", "b"]

steps = st.lists(st.one_of(
    st.tuples(st.just("register"), st.sampled_from(WORKERS),
              st.lists(st.sampled_from(SERVICES), min_size=1, max_size=2),
              st.integers(1, 2)),
    st.tuples(st.just("request"), st.sampled_from(CLIENTS), st.sampled_from(SERVICES),
              st.sampled_from([0.0, 0.2, 5.0]), st.sampled_from(["r1", "r2", "r3", "r4"])),
    st.tuples(st.just("reply"), st.sampled_from(WORKERS), st.integers(0, 3)),
    st.tuples(st.just("failure"), st.sampled_from(WORKERS), st.integers(0, 3)),
    st.tuples(st.just("cancel"), st.sampled_from(CLIENTS), st.sampled_from(["r1", "r2"])),
    st.tuples(st.just("heartbeat"), st.sampled_from(CLIENTS + WORKERS)),
    st.tuples(st.just("disconnect"), st.sampled_from(CLIENTS + WORKERS)),
    st.tuples(st.just("time"), st.sampled_from([0.05, 0.3, 1.1, 3.0])),
), max_size=40)


def as_sends(got: Forward | list[Send], side: Side, msg: protocol.Message) -> list[Send]:
    """The actions a ``Forward`` stands for: ``msg`` (the message just received),
    re-addressed as the dispatcher says."""
    if not isinstance(got, Forward):
        return got
    if isinstance(msg, protocol.Request):
        out: protocol.Message = protocol.Request(got.request_id, msg.service, got.budget_s,
                                                 msg.body, msg.attempt)
    else:
        assert isinstance(msg, protocol.Reply)
        out = protocol.Reply(got.request_id, msg.body)
    return [Send(side, got.identity, out)]


@given(steps, st.booleans())
@settings(max_examples=400, deadline=None)
def test_hot_path_has_the_effect_of_the_general_path(steps: list[tuple], hot_replies: bool
                                                     ) -> None:
    now = 100.0
    hot = Dispatcher("h" * 16, LIMITS, now)
    ref = Dispatcher("h" * 16, LIMITS, now)
    for step in steps:
        op = step[0]
        if op == "register":
            _, worker, services, capacity = step
            msg: protocol.Message = protocol.Ready(tuple(services), capacity)
            pair = hot.on_worker(worker, msg, now), ref.on_worker(worker, msg, now)
        elif op == "request":
            _, client, service, budget, rid = step
            msg = protocol.Request(rid, service, budget, b"body-" + rid.encode())
            got = hot.on_request(client, rid, service, budget, msg.body, msg.attempt, now)
            pair = as_sends(got, Side.WORKER, msg), ref.on_client(client, msg, now)
        elif op in ("reply", "failure"):
            _, worker, pick = step
            held = sorted(ref.held_by(worker)) or ["nope"]
            rid = held[pick % len(held)]
            if op == "reply":
                msg = protocol.Reply(rid, b"ok")
                got = (hot.on_reply(worker, rid, msg.body, now) if hot_replies
                       else hot.on_worker(worker, msg, now))
                pair = as_sends(got, Side.CLIENT, msg), ref.on_worker(worker, msg, now)
            else:
                msg = protocol.FailureReply(rid, "bad_request", "no", False)
                pair = hot.on_worker(worker, msg, now), ref.on_worker(worker, msg, now)
        elif op == "cancel":
            _, client, rid = step
            msg = protocol.Cancel(rid)
            pair = hot.on_client(client, msg, now), ref.on_client(client, msg, now)
        elif op in ("heartbeat", "disconnect"):
            peer = step[1]
            msg = protocol.Heartbeat("p") if op == "heartbeat" else protocol.Disconnect("bye")
            on = "on_client" if peer in CLIENTS else "on_worker"
            pair = getattr(hot, on)(peer, msg, now), getattr(ref, on)(peer, msg, now)
        else:
            now += step[1]
            pair = hot.tick(now), ref.tick(now)
        assert pair[0] == pair[1], step
        assert hot.status(now) == ref.status(now), step
        hot.check_invariants()


def test_a_request_to_an_idle_worker_is_forwarded_without_a_message_object() -> None:
    d = Dispatcher("h" * 16, LIMITS, 0.0)
    d.on_worker(b"w", protocol.Ready(("s",), 1), 0.0)
    d.on_client(b"c", protocol.Heartbeat("p"), 0.0)
    got = d.on_request(b"c", "r1", "s", 5.0, b"body", 1, 1.0)
    assert isinstance(got, Forward)
    assert got.identity == b"w"
    assert got.request_id in d.held_by(b"w")
    assert got.budget_s == 5.0
    # The worker is busy now: the next request is queued, through the general path.
    assert d.on_request(b"c", "r2", "s", 5.0, b"body", 1, 1.0) == []
    assert d.on_reply(b"w", got.request_id, b"ok", 2.0) == [
        Send(Side.CLIENT, b"c", protocol.Reply("r1", b"ok")),
        Send(Side.WORKER, b"w", protocol.Request(
            sorted(d.held_by(b"w"))[0], "s", 4.0, b"body", 1)),
    ]
    d.check_invariants()
