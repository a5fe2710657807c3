"""The worker's HTTP connection pools for model calls: httpx transports, in
shards, each request on the least busy one.

Why transports and not ``httpx.AsyncClient``: the client's layer above its
transport (URL merging, the auth and redirect generators, cookie extraction,
event hooks, response wrapping) cost about 0.25 ms per request on this
machine: first token from the scripted provider 1.90 ms through
``AsyncHTTPTransport.handle_async_request``, 2.15 ms through
``AsyncClient.stream`` (medians of 40 alternating calls, each after 30 ms
idle). The worker uses none of it:
it follows no redirects (a model API that redirects is misconfigured), keeps
no cookies (one jar shared by every session of a worker would carry state
from one session to the next), and its one auth header is set by ``http``.
So requests go straight to httpx's transport API, with the timeouts in
``request.extensions`` as the client would put them (``http.open_stream``).

Why shards: httpcore's connection pool walks all of its connections, checking
each for expiry (anyio socket attributes, a ``getpeername`` and a ``poll``),
every time a request starts or a response closes. Its CPU per request grows
with the number of open connections. Measured on this machine against the
scripted provider (HTTP/1.1, so one stream per connection): 0.83 ms of client
CPU per streamed request with 4 in flight, 1.5 ms with 16, 3.0 ms with 32. A
worker with 32 model calls in flight paid the 3 ms on every call. Shards of
at most ``SHARD_CONNECTIONS`` connections keep each walk short; over HTTP/2,
each shard multiplexes on its own connection.

Each request goes to the shard with the fewest requests in flight; on a tie,
the lowest index, so a lightly loaded worker keeps reusing the first shard's
warm connections.

Proxies: with ``trust_env``, ``HTTP_PROXY``, ``HTTPS_PROXY``, ``ALL_PROXY``
and ``NO_PROXY`` (either case) are honoured, as httpx's client does; a proxy
given without a scheme (``proxy.corp:3128``) is an ``http://`` one, as there.
They are read once, at start, and each proxy's transport is made then too, so
a bad proxy URL fails the start (as the client did), not every request. A
request whose host is not bypassed goes through the transport of its proxy:
one per proxy URL, with the whole configured limits (a proxied worker talks
to one or two proxies).

TLS: the one client context is httpx's default (``create_ssl_context``: the CA
bundle of ``SSL_CERT_FILE`` or ``SSL_CERT_DIR`` with ``trust_env``, else
certifi's), but its CA bundle is loaded the first time it wraps a connection
(``LazyCAContext``), not at start: loading it was a third of the pool's start
(0.05 of 0.16 CPU-s, more on a loaded machine), and a worker that only ever talks
plain http (every test farm, a provider behind a local gateway) never needs it.
Every TLS connection the transports make goes through ``wrap_bio`` or
``wrap_socket`` of that context, so none can be made before the CAs are there.

Closing: only transports ever leased are closed; one never leased holds no
connection, and closing it made httpcore set up its anyio cancel scope machinery
at stop (0.05 CPU-s for the 13 idle shards of a worker that made no model call).

Invariants:
- ``in_flight[i]`` counts the leases of shard ``i`` not yet ended; ``lease``
  always gives its count back, on any exit.
- The limits add up to exactly the configured ones: ``max_connections`` and the
  keep-alive cap are each split over the shards as evenly as integers allow.
- The set of transports is bounded: the shards, plus one per distinct proxy URL
  in the environment.
"""

from __future__ import annotations

import contextlib
import ipaddress
import math
import os
import ssl
import sys
import threading
from collections.abc import AsyncIterator, Mapping
from typing import Any, Final

import httpx

SHARD_CONNECTIONS: Final = 8


class ClientShards:
    """``lease(url)`` yields the transport for one request: its proxy's, or the
    least busy shard."""

    def __init__(self, *, max_connections: int, max_keepalive: int, keepalive_expiry_s: float,
                 http2: bool, trust_env: bool) -> None:
        if max_connections < 1 or max_keepalive < 0:
            raise ValueError("max_connections must be >= 1 and max_keepalive >= 0")
        count = math.ceil(max_connections / SHARD_CONNECTIONS)
        self.limits = [(_share(max_connections, count, i), _share(max_keepalive, count, i))
                       for i in range(count)]
        self._http2 = http2
        self._trust_env = trust_env
        self._expiry_s = keepalive_expiry_s
        # One TLS context for every shard: loading the CA bundle costs tens of ms
        # (0.44 s each on a loaded 2-core machine), and a context per transport
        # made a worker's start load it 13 times. An SSLContext is meant to be
        # shared; httpcore sets ALPN on it per connection from the same http2 flag.
        # It loads the bundle at its first TLS connection (LazyCAContext).
        self._ssl = lazy_tls_context(trust_env=trust_env)
        self.transports = [self._transport(connections, keepalive)
                           for connections, keepalive in self.limits]
        self.in_flight = [0] * count
        self._leased: set[int] = set()  # id() of every transport ever leased
        self.proxies: dict[str, str] = env_proxies(os.environ) if trust_env else {}
        self._via_proxy: dict[str, httpx.AsyncHTTPTransport] = {
            url: self._transport(max_connections, max_keepalive, proxy=url)
            for key, url in self.proxies.items() if key != "no"}

    def _transport(self, connections: int, keepalive: int,
                   proxy: str | None = None) -> httpx.AsyncHTTPTransport:
        return httpx.AsyncHTTPTransport(
            verify=self._ssl, http2=self._http2, trust_env=self._trust_env, proxy=proxy,
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=keepalive,
                                keepalive_expiry=self._expiry_s))

    @contextlib.asynccontextmanager
    async def lease(self, url: httpx.URL) -> AsyncIterator[httpx.AsyncHTTPTransport]:
        if not self.transports:
            raise RuntimeError("the model service's HTTP transports are closed")
        proxy = proxy_for(url, self.proxies) if self.proxies else None
        if proxy is not None:
            transport = self._via_proxy[proxy]
            self._leased.add(id(transport))
            yield transport
            return
        counts = self.in_flight
        i = counts.index(min(counts))
        counts[i] += 1
        try:
            transport = self.transports[i]
            self._leased.add(id(transport))
            yield transport
        finally:
            counts[i] -= 1

    async def aclose(self) -> None:
        transports = [t for t in (*self.transports, *self._via_proxy.values())
                      if id(t) in self._leased]
        self.transports, self.in_flight, self._via_proxy = [], [], {}
        self._leased = set()
        for transport in transports:
            await transport.aclose()


class LazyCAContext(ssl.SSLContext):
    """A TLS client context that loads its CA locations (``cafile``/``capath``,
    set by ``lazy_tls_context``) once, just before it wraps its first connection.
    ``ca_loaded`` says whether it has."""

    ca_loaded: bool
    _ca: tuple[str | None, str | None]
    _ca_lock: threading.Lock

    def wrap_socket(self, *args: Any, **kwargs: Any) -> ssl.SSLSocket:
        self._load_ca()
        return super().wrap_socket(*args, **kwargs)

    def wrap_bio(self, *args: Any, **kwargs: Any) -> ssl.SSLObject:
        self._load_ca()
        return super().wrap_bio(*args, **kwargs)

    def _load_ca(self) -> None:
        if self.ca_loaded:
            return
        with self._ca_lock:
            if not self.ca_loaded:
                cafile, capath = self._ca
                self.load_verify_locations(cafile=cafile, capath=capath)
                self.ca_loaded = True


def lazy_tls_context(*, trust_env: bool) -> LazyCAContext:
    """The context ``httpx.create_ssl_context(trust_env=trust_env)`` makes (which is
    ``ssl.create_default_context(cafile=...)``: certificates and host names
    verified; ``SSLKEYLOGFILE`` honoured), with its CA locations loaded at the
    first wrap. tests/model/test_tls_lazy.py pins that the two agree."""
    import certifi  # httpx's own dependency, the bundle it defaults to

    cafile: str | None = None
    capath: str | None = None
    if trust_env and os.environ.get("SSL_CERT_FILE"):
        cafile = os.environ["SSL_CERT_FILE"]
    elif trust_env and os.environ.get("SSL_CERT_DIR"):
        capath = os.environ["SSL_CERT_DIR"]
    else:
        cafile = certifi.where()
    ctx = LazyCAContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.check_hostname = True
    keylog = os.environ.get("SSLKEYLOGFILE")
    if keylog and not sys.flags.ignore_environment:
        ctx.keylog_filename = keylog
    ctx.ca_loaded = False
    ctx._ca = (cafile, capath)
    ctx._ca_lock = threading.Lock()
    return ctx


def env_proxies(environ: Mapping[str, str]) -> dict[str, str]:
    """``{scheme or "all": proxy URL, "no": NO_PROXY}`` from ``environ``; a lowercase
    variable wins over its uppercase twin (set empty, it unsets it), as in curl
    and urllib; a proxy without a scheme is ``http://``, as in httpx."""
    found: dict[str, str] = {}
    for lowercase_pass in (False, True):
        for name, value in environ.items():
            lower = name.lower()
            key = lower.removesuffix("_proxy")
            if key == lower or key not in ("http", "https", "all", "no"):
                continue
            if lowercase_pass and name == lower and not value:
                found.pop(key, None)
            elif value and (name == lower or not lowercase_pass):
                found[key] = value if key == "no" or "://" in value else f"http://{value}"
    return found


def proxy_for(url: httpx.URL, proxies: Mapping[str, str]) -> str | None:
    """The proxy URL a request to ``url`` goes through, or None (direct)."""
    proxy = proxies.get(url.scheme) or proxies.get("all")
    if proxy is None:
        return None
    no_proxy = proxies.get("no", "")
    if no_proxy and _bypassed(url, no_proxy):
        return None
    return proxy


def _bypassed(url: httpx.URL, no_proxy: str) -> bool:
    """NO_PROXY matching as curl and urllib do it: ``*``; a host, or a domain
    suffix (a leading dot is optional); ``host:port``; and, as httpx adds, an IP
    network in CIDR form."""
    host = url.host.lower()
    try:
        address: ipaddress.IPv4Address | ipaddress.IPv6Address | None = \
            ipaddress.ip_address(host)
    except ValueError:
        address = None
    for entry in no_proxy.lower().split(","):
        name = entry.strip().lstrip(".")
        if not name:
            continue
        if name == "*":
            return True
        if "/" in name and address is not None:
            with contextlib.suppress(ValueError):
                if address in ipaddress.ip_network(name, strict=False):
                    return True
            continue
        name, _, port = name.partition(":") if name.count(":") == 1 else (name, "", "")
        if port and port != str(url.port or (443 if url.scheme == "https" else 80)):
            continue
        if host == name or host.endswith("." + name):
            return True
    return False


def _share(total: int, parts: int, i: int) -> int:
    """Part ``i`` of ``total`` split over ``parts`` (the first ones get the remainder)."""
    return total // parts + (1 if i < total % parts else 0)
