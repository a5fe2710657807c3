"""The model service's transports verify TLS with one shared context.

A real TLS server on loopback with a self-signed certificate made for the test
(``openssl``): every shard verifies it when ``SSL_CERT_FILE`` names it (the
context honours the environment when ``trust_env`` is on), and refuses it
when nothing vouches for it. The shards share one context (loading the CA
bundle once per transport made a worker's start 10x slower).
"""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from sandbox_worker.model.pool import ClientShards

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")]


@pytest.fixture
def cert(tmp_path: Path) -> tuple[Path, Path]:
    crt, key = tmp_path / "c.pem", tmp_path / "k.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(crt)],
                   check=True, capture_output=True, timeout=30)
    return crt, key


@pytest.fixture
async def tls_url(cert: tuple[Path, Path]) -> AsyncIterator[httpx.URL]:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(cert[0]), str(cert[1]))

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(10):
                await reader.readuntil(b"\r\n\r\n")
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n"
                             b"Connection: close\r\n\r\nok")
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            pass  # a refused handshake ends here
        finally:
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=ctx)
    port = server.sockets[0].getsockname()[1]
    try:
        yield httpx.URL(f"https://127.0.0.1:{port}/v1/responses")
    finally:
        server.close()
        await server.wait_closed()


async def get(transport: httpx.AsyncHTTPTransport, url: httpx.URL) -> int:
    request = httpx.Request("GET", url, extensions={"timeout": {
        "connect": 10.0, "read": 10.0, "write": 10.0, "pool": 10.0}})
    response = await transport.handle_async_request(request)
    await response.aread()
    await response.aclose()
    return response.status_code


async def test_every_shard_verifies_with_the_one_context(
        tls_url: httpx.URL, cert: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(cert[0]))
    pool = ClientShards(max_connections=24, max_keepalive=8, keepalive_expiry_s=5.0,
                        http2=False, trust_env=True)
    try:
        assert len(pool.transports) == 3
        contexts = {id(t._pool._ssl_context) for t in pool.transports}
        assert len(contexts) == 1
        for transport in pool.transports:
            assert await get(transport, tls_url) == 200
        async with pool.lease(tls_url) as transport:
            assert await get(transport, tls_url) == 200
    finally:
        await pool.aclose()


async def test_an_unknown_certificate_is_refused(
        tls_url: httpx.URL, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    pool = ClientShards(max_connections=8, max_keepalive=8, keepalive_expiry_s=5.0,
                        http2=False, trust_env=True)
    try:
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            await get(pool.transports[0], tls_url)
    finally:
        await pool.aclose()
