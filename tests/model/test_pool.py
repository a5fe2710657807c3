"""ClientShards: the model service's httpx transports, least busy first; env proxies."""

from __future__ import annotations

import contextlib
import json

import httpx
import pytest

from sandbox_worker.api import ModelCallRequest
from sandbox_worker.fakellm.script import parse_script
from sandbox_worker.fakellm.server import FakeLLM
from sandbox_worker.model.http import build_request, open_stream
from sandbox_worker.model.pool import SHARD_CONNECTIONS, ClientShards, env_proxies, proxy_for

URL = httpx.URL("http://127.0.0.1:9/v1/responses")


def shards(max_connections: int = 100) -> ClientShards:
    return ClientShards(max_connections=max_connections, max_keepalive=32,
                        keepalive_expiry_s=30.0, http2=False, trust_env=False)


async def test_connections_are_split_over_small_shards() -> None:
    pool = shards(100)
    try:
        assert len(pool.transports) == 13  # ceil(100 / 8)
        assert len(shards(1).transports) == 1
        assert len(shards(SHARD_CONNECTIONS).transports) == 1
        assert len(shards(SHARD_CONNECTIONS + 1).transports) == 2
        # the shares add up to exactly the configured limits
        assert sum(c for c, _ in pool.limits) == 100
        assert sum(k for _, k in pool.limits) == 32
        assert max(c for c, _ in pool.limits) <= SHARD_CONNECTIONS
        nine = shards(9)
        assert nine.limits == [(5, 16), (4, 16)]
        await nine.aclose()
        with pytest.raises(RuntimeError, match="closed"):
            async with nine.lease(URL):
                pass
    finally:
        await pool.aclose()


async def test_each_lease_takes_the_least_busy_shard_and_gives_it_back() -> None:
    pool = shards(24)  # 3 shards
    try:
        async with contextlib.AsyncExitStack() as stack:
            held = [await stack.enter_async_context(pool.lease(URL)) for _ in range(4)]
            # spread: 0, 1, 2, then the first of the least busy again
            assert [pool.transports.index(t) for t in held] == [0, 1, 2, 0]
            assert pool.in_flight == [2, 1, 1]
        assert pool.in_flight == [0, 0, 0]
        async with pool.lease(URL) as transport:  # idle: the first shard's warm connections
            assert transport is pool.transports[0]
        with pytest.raises(RuntimeError):
            async with pool.lease(URL):
                raise RuntimeError("the request failed")
        assert pool.in_flight == [0, 0, 0]
    finally:
        await pool.aclose()


def test_env_proxies_lowercase_wins_and_only_proxy_variables_count() -> None:
    env = {"HTTPS_PROXY": "http://upper:3128", "https_proxy": "http://lower:3128",
           "HTTP_PROXY": "http://p:8080", "NO_PROXY": "internal", "FTP_PROXY": "http://f",
           "ALL_PROXY": "", "PROXY": "x", "PATH": "/bin"}
    assert env_proxies(env) == {"https": "http://lower:3128", "http": "http://p:8080",
                                "no": "internal"}
    assert env_proxies({"PATH": "/bin"}) == {}


def test_env_proxies_as_httpx_reads_them() -> None:
    """A proxy without a scheme is an http:// one; an empty lowercase variable
    unsets its uppercase twin (urllib's getproxies, which httpx's client used)."""
    env = {"HTTPS_PROXY": "user:s3cret@proxy.corp:3128", "HTTP_PROXY": "http://p:8080",
           "http_proxy": "", "NO_PROXY": "internal,.corp"}
    assert env_proxies(env) == {"https": "http://user:s3cret@proxy.corp:3128",
                                "no": "internal,.corp"}


def test_proxy_transports_are_made_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad proxy fails the start, as httpx's client did, rather than every request
    (whose failure message would carry the proxy URL, credentials and all)."""
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "no_proxy",
                 "NO_PROXY", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", "proxy.corp:3128")
    pool = ClientShards(max_connections=8, max_keepalive=8, keepalive_expiry_s=30.0,
                        http2=False, trust_env=True)
    assert list(pool._via_proxy) == ["http://proxy.corp:3128"]
    monkeypatch.setenv("HTTPS_PROXY", "ftp://proxy.corp:21")
    with pytest.raises(ValueError, match="scheme"):
        ClientShards(max_connections=8, max_keepalive=8, keepalive_expiry_s=30.0,
                     http2=False, trust_env=True)


@pytest.mark.parametrize(("url", "no_proxy", "expected"), [
    ("http://api.example.com/v1", "", "http://p:8080"),
    ("http://api.example.com/v1", "*", None),
    ("http://api.example.com/v1", "example.com", None),  # a domain suffix
    ("http://api.example.com/v1", ".example.com", None),  # ... with its leading dot
    ("http://notexample.com/v1", "example.com", "http://p:8080"),  # not a suffix match
    ("http://api.example.com:8000/v1", "api.example.com:8000", None),
    ("http://api.example.com:8001/v1", "api.example.com:8000", "http://p:8080"),
    ("http://api.example.com/v1", "api.example.com:80", None),  # the default port
    ("http://10.1.2.3:8000/v1", "localhost, 10.0.0.0/8", None),  # CIDR
    ("http://11.1.2.3:8000/v1", "10.0.0.0/8", "http://p:8080"),
    ("https://api.example.com/v1", "", "http://all:1"),  # no https proxy: the all proxy
])
def test_proxy_for_honours_no_proxy(url: str, no_proxy: str, expected: str | None) -> None:
    proxies = {"http": "http://p:8080", "all": "http://all:1"}
    if no_proxy:
        proxies["no"] = no_proxy
    assert proxy_for(httpx.URL(url), proxies) == expected


async def test_a_proxied_request_goes_through_the_proxy_transport(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """HTTP_PROXY set: a request to an unresolvable host reaches the scripted
    provider, which stands in for the proxy (it serves absolute-form targets).
    A host in NO_PROXY gets a direct shard instead."""
    async with FakeLLM(parse_script({"responses": [{"text": "via proxy"}]})) as fake:
        for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "no_proxy",
                     "http_proxy"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HTTP_PROXY", fake.url)
        monkeypatch.setenv("NO_PROXY", "bypassed.invalid")
        pool = ClientShards(max_connections=8, max_keepalive=8, keepalive_expiry_s=30.0,
                            http2=False, trust_env=True)
        req: ModelCallRequest = {
            "op": "respond", "route": {"name": "r", "provider": "openai-responses",
                                       "model": "m", "base_url": "http://model.invalid/v1"},
            "instructions": "", "items": [{"type": "message", "role": "user", "content": "x"}],
            "tools": [], "stream": False, "session_id": "s"}
        try:
            request = build_request(req, api_key=None, attempt_no=1, stream=False,
                                    http_timeout=httpx.Timeout(10.0))
            async with pool.lease(request.url) as transport, \
                    open_stream(transport, request) as resp:
                assert transport not in pool.transports  # the proxy's own transport
                assert resp.status_code == 200
                body = json.loads(await resp.aread())
            assert "via proxy" in json.dumps(body)
            assert pool.in_flight == [0]
            assert fake.stats()["by_path"] == {"/v1/responses": 1}
            async with pool.lease(httpx.URL("http://bypassed.invalid/v1/responses")) as direct:
                assert direct is pool.transports[0]
        finally:
            await pool.aclose()
