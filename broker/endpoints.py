"""ZeroMQ endpoints given on a command line or in corral.toml, checked before use.

libzmq's own parsing is lax and its errors come late: ``nonsense`` fails as a Python
traceback from inside a running process, and ``tcp://HOST:99999`` is taken as a
request for any free port (a bind then silently listens elsewhere). Every process's
endpoint options are typed with these checks, so a bad one is an argparse usage error
(exit 2) naming the option and the forms that work.

Forms: ``tcp://HOST:PORT`` (HOST a name, an IPv4 address or a bracketed IPv6 one;
PORT 1..65535; a bind also takes HOST ``*`` and PORT ``0`` or ``*``: any free port),
``ipc://PATH`` and ``inproc://NAME`` (non-empty, no whitespace).

Invariant: a checked endpoint is returned unchanged; nothing here touches a socket.
"""

from __future__ import annotations

import argparse
import re

_TCP = re.compile(r"tcp://(?P<host>\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(?P<port>\*|\d+)")
FORMS = "tcp://HOST:PORT (PORT 1..65535) or ipc:///PATH"


def problem(text: str, *, bind: bool) -> str | None:
    """Why ``text`` is not a usable endpoint (None: it is)."""
    for scheme in ("ipc://", "inproc://"):
        if text.startswith(scheme):
            rest = text[len(scheme):]
            if not rest or any(c.isspace() or c == "\x00" for c in rest):
                return f"{text!r}: an empty or blank {scheme} path"
            return None
    m = _TCP.fullmatch(text)
    if m is None:
        return f"{text!r} is not an endpoint: give {FORMS}"
    port, host = m.group("port"), m.group("host")
    if port == "*" or int(port) == 0:
        return None if bind else f"{text!r}: a port to connect to must be 1..65535"
    if not 1 <= int(port) <= 65535:
        return f"{text!r}: port {int(port)} is not in 1..65535"
    if host == "*" and not bind:
        return f"{text!r}: '*' is for binding; give the host to connect to"
    return None


def bind_endpoint(text: str) -> str:
    """argparse ``type=`` of an endpoint to bind."""
    why = problem(text, bind=True)
    if why is not None:
        raise argparse.ArgumentTypeError(why)
    return text


def connect_endpoint(text: str) -> str:
    """argparse ``type=`` of an endpoint to connect to."""
    why = problem(text, bind=False)
    if why is not None:
        raise argparse.ArgumentTypeError(why)
    return text
