"""The model pool's TLS context loads its CA bundle at its first TLS connection,
and is then the context httpx would have made.

A worker that only talks plain http never pays for the CA bundle (a third of
the pool's start); these pin that the deferral changes nothing else: every
setting and every CA of the loaded context match ``httpx.create_ssl_context``'s
for the same environment, and a wrap always loads first.
"""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

import certifi
import httpx
import pytest

from sandbox_worker.model.pool import ClientShards, lazy_tls_context

pytestmark = pytest.mark.timeout(30)


def settings(ctx: ssl.SSLContext) -> dict[str, object]:
    return {"verify_mode": ctx.verify_mode, "check_hostname": ctx.check_hostname,
            "options": ctx.options, "verify_flags": ctx.verify_flags,
            "minimum_version": ctx.minimum_version, "maximum_version": ctx.maximum_version,
            "protocol": ctx.protocol, "ciphers": [c["name"] for c in ctx.get_ciphers()],
            "keylog": ctx.keylog_filename, "post_handshake_auth": ctx.post_handshake_auth,
            "cas": sorted(ctx.get_ca_certs(binary_form=True))}


@pytest.mark.parametrize("env", ["none", "file", "dir", "keylog"])
@pytest.mark.parametrize("trust_env", [True, False])
def test_the_loaded_context_is_httpx_s(env: str, trust_env: bool, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SSL_CERT_FILE", "SSL_CERT_DIR", "SSLKEYLOGFILE"):
        monkeypatch.delenv(name, raising=False)
    if env == "file":
        one = tmp_path / "one.pem"  # a bundle of a single CA, unlike certifi's
        one.write_text(ssl.DER_cert_to_PEM_cert(
            ssl.create_default_context(cafile=certifi.where())
            .get_ca_certs(binary_form=True)[0]))
        monkeypatch.setenv("SSL_CERT_FILE", str(one))
    elif env == "dir":
        monkeypatch.setenv("SSL_CERT_DIR", str(tmp_path))
    elif env == "keylog":
        monkeypatch.setenv("SSLKEYLOGFILE", str(tmp_path / "keys.log"))
    lazy = lazy_tls_context(trust_env=trust_env)
    assert not lazy.ca_loaded
    assert lazy.get_ca_certs() == []
    lazy._load_ca()
    assert lazy.ca_loaded
    assert settings(lazy) == settings(httpx.create_ssl_context(trust_env=trust_env))


def test_a_wrap_loads_the_cas_first() -> None:
    ctx = lazy_tls_context(trust_env=False)
    ctx.wrap_bio(ssl.MemoryBIO(), ssl.MemoryBIO(), server_hostname="example.com")
    assert ctx.ca_loaded
    assert ctx.get_ca_certs()
    ctx = lazy_tls_context(trust_env=False)
    with socket.socket() as sock, ctx.wrap_socket(sock, server_hostname="example.com",
                                                   do_handshake_on_connect=False):
        assert ctx.ca_loaded
        assert ctx.get_ca_certs()


async def test_a_pool_that_talks_plain_http_never_loads_them() -> None:
    pool = ClientShards(max_connections=16, max_keepalive=4, keepalive_expiry_s=5.0,
                        http2=False, trust_env=True)
    try:
        async with pool.lease(httpx.URL("http://127.0.0.1:9/v1/responses")):
            pass
        assert not pool._ssl.ca_loaded
    finally:
        await pool.aclose()
