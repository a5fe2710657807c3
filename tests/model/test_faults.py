"""Typed failures and retries through a real broker and worker, for all three
wire formats: rate limits, server errors until the budget runs out, hangs
ended by a cancel, broken streams, auth errors, a worker killed mid-stream."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from pathlib import Path

import pytest

from broker.client import BrokerClient
from broker.errors import RequestFailed
from broker.protocol import pack, unpack
from sandbox_worker.api import SERVICE_MODEL
from tests.helpers import Procs, eventually
from tests.model.stack import (
    PROVIDERS,
    Stacks,
    astats,
    request,
    run_call,
    start_fake,
    start_stack,
    stats,
)

# One shared broker+worker stack per worker-option set (conftest.py's
# ``stacks``), also under xdist (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("model-faults")

LONG = " ".join(f"word{i}" for i in range(120))


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_rate_limit_honours_retry_after_then_succeeds(
        procs: Procs, stacks: Stacks, tmp_path: Path, provider: str) -> None:
    url = start_fake(procs, tmp_path, {"responses": [
        {"status": 429, "retry_after_s": 1, "times": 1, "text": "after the wait"}]})
    stack = stacks.get()
    async with BrokerClient(stack.frontend) as client:
        started = time.monotonic()
        out = await run_call(client, request(provider, url))
        elapsed = time.monotonic() - started
    assert out.error is None, out.error
    assert out.result is not None
    retries = [p for p in out.partials if p["type"] == "retry"]
    assert len(retries) == 1
    assert retries[0]["kind"] == "rate_limited"
    assert retries[0]["delay_s"] == 1.0
    assert retries[0]["attempt"] == 2
    assert retries[0]["discard_partial"] is False
    assert elapsed >= 0.95, "Retry-After was not honoured"
    assert out.result["retries"] == 1
    assert out.text() == "after the wait"
    assert stats(url)["by_status"] == {"429": 1, "200": 1}


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_server_error_retried_until_the_budget_runs_out(
        procs: Procs, stacks: Stacks, tmp_path: Path, provider: str) -> None:
    url = start_fake(procs, tmp_path, {"responses": [{"status": 500}]})
    stack = stacks.get("--model-backoff-base-s", "0.1",
                        "--model-backoff-max-s", "0.4")
    async with BrokerClient(stack.frontend) as client:
        started = time.monotonic()
        out = await run_call(client, request(provider, url, max_retries=1000), timeout_s=3.0)
        elapsed = time.monotonic() - started
    assert out.error is not None
    failure = out.error.failure
    assert failure.kind == "server_error"
    assert failure.retryable is True
    assert "budget exhausted" in failure.message
    assert "HTTP 500" in failure.message
    assert unpack(out.error.body)["discard_partial"] is False
    served = stats(url)["by_status"]["500"]
    retries = [p for p in out.partials if p["type"] == "retry"]
    assert served >= 4
    assert len(retries) == served - 1
    assert all(r["kind"] == "server_error" for r in retries)
    assert elapsed < 3.0 + 1.0, "the worker answered after the request's deadline"


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_cancel_closes_a_hanging_stream_within_a_second(
        procs: Procs, stacks: Stacks, tmp_path: Path, provider: str) -> None:
    url = start_fake(procs, tmp_path, {"responses": [{"hang": True}]})
    stack = stacks.get()
    async with BrokerClient(stack.frontend) as client:
        call = client.start(SERVICE_MODEL, pack(request(provider, url)), budget_s=30)

        async def hanging() -> bool:
            return bool((await astats(url))["active"] == 1)

        await eventually(hanging, timeout_s=10, what="the request to reach the provider")
        started = time.monotonic()
        await call.cancel()

        async def closed() -> bool:
            return bool((await astats(url))["active"] == 0)

        await eventually(closed, timeout_s=5, what="the provider to see the connection close")
        assert time.monotonic() - started < 1.0
        with pytest.raises(RequestFailed) as info:
            await call.result()
        assert info.value.kind == "cancelled"


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_broken_stream_is_retried_and_partial_output_discarded(
        procs: Procs, stacks: Stacks, tmp_path: Path, provider: str) -> None:
    url = start_fake(procs, tmp_path, {"responses": [
        {"text": LONG, "cut_after_bytes": 1200, "times": 1, "chunk_delay_s": 0.002}]})
    stack = stacks.get("--model-backoff-base-s", "0.05")
    async with BrokerClient(stack.frontend) as client:
        out = await run_call(client, request(provider, url))
    assert out.error is None, out.error
    assert out.result is not None
    kinds = [p["type"] for p in out.partials]
    cut = kinds.index("retry")
    assert "text_delta" in kinds[:cut], "nothing was relayed before the break"
    retry = out.partials[cut]
    assert retry["kind"] == "stream_error"
    assert retry["discard_partial"] is True
    assert out.text() == LONG  # what is left after discarding is the full answer
    assert out.result["retries"] == 1


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_broken_stream_final_failure_says_discard(
        procs: Procs, stacks: Stacks, tmp_path: Path, provider: str) -> None:
    url = start_fake(procs, tmp_path, {"responses": [
        {"text": LONG, "cut_after_bytes": 1200, "chunk_delay_s": 0.002}]})
    stack = stacks.get()
    async with BrokerClient(stack.frontend) as client:
        out = await run_call(client, request(provider, url, max_retries=0))
    assert out.error is not None
    failure = out.error.failure
    assert failure.kind == "stream_error"
    assert failure.retryable is True
    assert "discard" in failure.message
    assert unpack(out.error.body)["discard_partial"] is True
    assert any(p["type"] == "text_delta" for p in out.partials)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_malformed_stream_is_a_retryable_stream_error(
        procs: Procs, stacks: Stacks, tmp_path: Path, provider: str) -> None:
    url = start_fake(procs, tmp_path, {"responses": [
        {"text": LONG, "malformed": True, "times": 1}]})
    stack = stacks.get("--model-backoff-base-s", "0.05")
    async with BrokerClient(stack.frontend) as client:
        out = await run_call(client, request(provider, url))
    assert out.error is None, out.error
    retries = [p for p in out.partials if p["type"] == "retry"]
    assert [r["kind"] for r in retries] == ["stream_error"]
    assert out.text() == LONG


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_auth_error_is_not_retried(
        procs: Procs, stacks: Stacks, tmp_path: Path, provider: str) -> None:
    url = start_fake(procs, tmp_path, {"responses": [
        {"status": 401, "error_message": "invalid x-api-key"}]})
    stack = stacks.get()
    async with BrokerClient(stack.frontend) as client:
        out = await run_call(client, request(provider, url))
    assert out.error is not None
    failure = out.error.failure
    assert failure.kind == "auth"
    assert failure.retryable is False
    assert "HTTP 401" in failure.message
    assert "invalid x-api-key" in failure.message
    assert out.partials == []
    assert stats(url)["requests"] == 1


async def test_bad_request_payload_is_rejected(
        procs: Procs, stacks: Stacks, tmp_path: Path) -> None:
    stack = stacks.get()
    async with BrokerClient(stack.frontend) as client:
        out = await run_call(client, {"op": "respond", "route": {"provider": "nope"}})
    assert out.error is not None
    assert out.error.failure.kind == "bad_request"
    assert out.error.failure.retryable is False


async def test_script_exhausted_is_a_clear_bad_request(
        procs: Procs, stacks: Stacks, tmp_path: Path) -> None:
    url = start_fake(procs, tmp_path, {"responses": []})
    stack = stacks.get()
    async with BrokerClient(stack.frontend) as client:
        out = await run_call(client, request("openai-responses", url))
    assert out.error is not None
    assert out.error.failure.kind == "bad_request"
    assert "script exhausted" in out.error.failure.message


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_worker_killed_mid_stream_then_retry_gets_same_answer(
        procs: Procs, tmp_path: Path, provider: str) -> None:
    url = start_fake(procs, tmp_path, {"responses": [
        {"text": LONG, "chunk_delay_s": 0.02}]})
    # Both workers are up before the call: the test's event loop must never
    # block (a blocked client misses heartbeats and the broker drops it).
    stack = start_stack(procs, tmp_path, workers=2)
    body = pack(request(provider, url))
    async with BrokerClient(stack.frontend) as client:
        call = client.start(SERVICE_MODEL, body, budget_s=30)
        seen: list[str] = []
        async for partial in call:
            delta = unpack(partial)
            if delta["type"] == "text_delta":
                seen.append(delta["text"])
                break
        assert seen, "no output before the kill"
        status = await client.status()
        busy = [w["info"]["pid"] for w in status["workers"][SERVICE_MODEL]["workers"]
                if w["in_flight"] == 1]
        assert len(busy) == 1
        [victim] = [w for w in stack.workers if w.pid == busy[0]]
        victim.send_signal(signal.SIGKILL)
        await asyncio.to_thread(victim.wait, 10)
        with pytest.raises(RequestFailed) as info:
            async with asyncio.timeout(10):
                await call.result()
        assert info.value.kind == "worker_lost"
        assert info.value.failure.retryable is True
        again = await run_call(client, request(provider, url))
    assert again.error is None, again.error
    assert again.text() == LONG
    assert LONG.startswith("".join(seen))
    assert stats(url)["by_k"] == {"0": 2}


async def test_connection_refused_is_a_retryable_connect_error(
        procs: Procs, stacks: Stacks, tmp_path: Path) -> None:
    # A bound socket that never listens: connections to it are refused, and no
    # other test can take its port while it is held.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
        stack = stacks.get("--model-backoff-base-s", "0.05")
        async with BrokerClient(stack.frontend) as client:
            out = await run_call(client, request("openai-chat", url, max_retries=2))
    assert out.error is not None
    assert out.error.failure.kind == "connect_error"
    assert out.error.failure.retryable is True
    assert [p["kind"] for p in out.partials] == ["connect_error", "connect_error"]


async def test_read_timeout_is_a_retryable_timeout(
        procs: Procs, stacks: Stacks, tmp_path: Path) -> None:
    url = start_fake(procs, tmp_path, {"responses": [{"hang": True, "times": 1,
                                                      "text": "second try"}]})
    stack = stacks.get("--model-backoff-base-s", "0.05")
    async with BrokerClient(stack.frontend) as client:
        started = time.monotonic()
        out = await run_call(client, request("anthropic", url, read_timeout_s=0.5))
    assert out.error is None, out.error
    assert [p["kind"] for p in out.partials if p["type"] == "retry"] == ["timeout"]
    assert out.text() == "second try"
    assert time.monotonic() - started < 10


async def test_a_reissued_call_counts_its_broker_attempt(
        procs: Procs, stacks: Stacks, tmp_path: Path) -> None:
    """The supervisor re-issues a lost call with attempt + 1; the provider sees that
    attempt, so a fault limited to the first attempt does not strike again."""
    url = start_fake(procs, tmp_path, {"responses": [
        {"status": 500, "times": 1, "text": "second attempt"}]})
    stack = stacks.get()
    async with BrokerClient(stack.frontend) as client:
        out = await run_call(client, request("openai-responses", url), attempt=2)
    assert out.error is None, out.error
    assert out.text() == "second attempt"
    assert not [p for p in out.partials if p["type"] == "retry"]
    assert stats(url)["by_status"] == {"200": 1}
