"""Plain records of the broker's dispatch state machine (``broker.state``).

- ``Limits``: the bounds and timing the dispatcher enforces.
- ``Send`` and ``Side``: the actions it returns (send this message to that peer);
  ``Forward``: the one action of its hot path (forward what just came in).
- ``Req``, ``WorkerEntry``, ``ClientEntry``: its bookkeeping entries. They hold
  data only; every state change is made by ``Dispatcher`` (one source of truth,
  described in its module docstring).
"""

from __future__ import annotations

import enum
import time
import uuid
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

from broker import protocol

MAX_STATUS_CLIENTS: Final = 256


class Side(enum.Enum):
    CLIENT = "client"
    WORKER = "worker"


class Send(NamedTuple):
    """Action: send ``msg`` to the peer ``identity`` on the ``side`` socket.

    A NamedTuple rather than a frozen dataclass: two are made per request."""

    side: Side
    identity: bytes
    msg: protocol.Message


class Forward(NamedTuple):
    """Action of the dispatcher's hot path (``on_request``/``on_reply``): forward the
    message just received to ``identity``, under ``request_id`` (and, for a
    request, with ``budget_s`` left). The same as one ``Send``, without building
    the message: the socket loop frames it from the fields it already has."""

    identity: bytes
    request_id: str
    budget_s: float


@dataclass(frozen=True, slots=True)
class Limits:
    heartbeat_interval_s: float = 0.25
    liveness: int = 4
    queue_limit: int = 10_000  # queued requests per service
    max_queued_services: int = 1024  # distinct services with a non-empty queue
    max_workers: int = 4096
    max_clients: int = 4096
    max_requests: int = 200_000  # queued + held, over all clients
    max_queued_bytes: int = 512 * 1024 * 1024  # request bodies waiting in queues
    max_expired_clients: int = 1024  # expired clients whose dropped requests are remembered

    # Clients get a longer window than workers. A dead worker must be noticed
    # fast, since its callers wait; a client's expiry only reclaims the work of
    # a client that is gone, while a false one (a supervisor whose loop stalled
    # under load) fails every call it has in flight.
    client_liveness: int = 40

    @property
    def window_s(self) -> float:
        """A worker silent for this long is declared dead."""
        return self.heartbeat_interval_s * self.liveness

    @property
    def client_window_s(self) -> float:
        """A client silent for this long is declared gone (never shorter than a worker's)."""
        return self.heartbeat_interval_s * max(self.liveness, self.client_liveness)


class Req:
    __slots__ = (
        "attempt", "body", "cancel_at", "client", "client_rid", "closed", "deadline", "rid",
        "seq", "service", "worker",
    )

    def __init__(
        self, rid: str, seq: int, client: bytes, client_rid: str, service: str,
        body: bytes, attempt: int, deadline: float,
    ) -> None:
        self.rid = rid
        self.seq = seq
        self.client = client
        self.client_rid = client_rid
        self.service = service
        self.body = body
        self.attempt = attempt
        self.deadline = deadline
        self.worker: bytes | None = None
        self.closed = False
        self.cancel_at = 0.0  # when CANCEL was last sent to its worker (closed and held)


class WorkerEntry:
    __slots__ = ("answered", "capacity", "identity", "in_flight", "info", "last_seen", "lowered",
                 "services")

    def __init__(
        self, identity: bytes, services: tuple[str, ...], capacity: int,
        info: dict[str, Any], now: float,
    ) -> None:
        self.identity = identity
        self.services = services
        self.capacity = capacity
        self.info = info
        self.last_seen = now
        self.in_flight: dict[str, Req] = {}
        self.answered = 0  # requests this worker answered (REPLY or FAILURE)
        self.lowered = False  # the worker lowered its capacity (HEARTBEAT capacity)


class ClientEntry:
    __slots__ = ("identity", "instance", "last_seen", "pending")

    def __init__(self, identity: bytes, now: float) -> None:
        self.identity = identity
        self.instance = ""  # the peer_id of its heartbeats: changes if the client restarts
        self.last_seen = now
        self.pending: dict[str, Req] = {}  # client request id -> request, not closed


def peer_name(identity: bytes) -> str:
    return identity.decode("utf-8", "backslashreplace")


def new_broker_id() -> str:
    """A fresh instance id; a restarted broker gets a new one."""
    return f"{uuid.uuid4().hex[:16]}-{int(time.time())}"
