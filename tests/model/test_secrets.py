"""API keys stay on the worker: used in the provider's header, never in a log
line (even at debug level), a failure message or a PARTIAL."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from broker.client import BrokerClient
from sandbox_worker.api import ModelRoute
from sandbox_worker.model import secrets
from sandbox_worker.model.errors import AuthError
from tests.helpers import Procs
from tests.model.stack import PROVIDERS, recorded, request, run_call, start_fake, start_stack

OPENAI_KEY = "sk-test-OPENAI-5f1e2d3c4b5a69788796a5b4c3d2e1f0"
ANTHROPIC_KEY = "sk-ant-test-ANTHROPIC-0a1b2c3d4e5f60718293a4b5c6d7e8f9"
CUSTOM_KEY = "custom-secret-key-1234567890abcdef"


async def test_no_api_key_in_worker_debug_log(procs: Procs, tmp_path: Path) -> None:
    # The provider echoes the key in its error message, as real providers do.
    url = start_fake(procs, tmp_path, {"responses": [
        {"text": "fine", "status": 401, "times": 1,
         "error_message": f"Incorrect API key provided: {OPENAI_KEY} / {ANTHROPIC_KEY}"}]})
    env = {"OPENAI_API_KEY": OPENAI_KEY, "ANTHROPIC_API_KEY": ANTHROPIC_KEY,
           "MY_KEY_VAR_API_KEY": CUSTOM_KEY}
    stack = start_stack(procs, tmp_path, "--log-level", "debug", env=env)
    async with BrokerClient(stack.frontend) as client:
        for provider in PROVIDERS:
            out = await run_call(client, request(provider, url))
            assert out.error is not None
            assert out.error.failure.kind == "auth"
            for key in (OPENAI_KEY, ANTHROPIC_KEY):
                assert key not in out.error.failure.message
            assert "[REDACTED]" in out.error.failure.message
        custom = await run_call(client, request("openai-chat", url,
                                                credential_env="MY_KEY_VAR_API_KEY"))
        assert custom.error is not None
        assert CUSTOM_KEY not in custom.error.failure.message
    # The keys were really sent, each in its provider's header.
    auth = [(r["path"], r["auth"]) for r in recorded(url)]
    assert auth == [("/responses", "bearer"), ("/chat/completions", "bearer"),
                    ("/v1/messages", "x-api-key"), ("/chat/completions", "bearer")]
    stack.workers[0].terminate()
    stack.workers[0].wait(timeout=15)
    log = procs.log(stack.workers[0])
    assert "DEBUG" in log, "the worker did not log at debug level"
    assert "httpcore" in log, "httpcore debug records were not logged"
    assert "[REDACTED]" in log
    for key in (OPENAI_KEY, ANTHROPIC_KEY, CUSTOM_KEY):
        assert key not in log


async def test_a_key_in_the_providers_output_is_redacted(procs: Procs, tmp_path: Path) -> None:
    """A provider (a proxy echoing its headers, a hostile endpoint) whose output
    holds the worker's key: the key reaches neither the PARTIALs nor the result
    (the transcript, checkpoints, exports and tool arguments are made of these),
    streamed or not, text or tool-call arguments."""
    url = start_fake(procs, tmp_path, {"responses": [
        {"text": f"your key is {OPENAI_KEY}, and {CUSTOM_KEY}"},
        {"tool_calls": [{"name": "shell", "arguments": {"command": f"echo {OPENAI_KEY}"}}]},
    ] * 2})
    env = {"OPENAI_API_KEY": OPENAI_KEY, "MY_KEY_VAR_API_KEY": CUSTOM_KEY}
    stack = start_stack(procs, tmp_path, env=env)
    said = {"type": "message", "role": "user", "content": "hello"}
    async with BrokerClient(stack.frontend) as client:
        for stream in (True, False):
            text = await run_call(client, request("openai-chat", url, stream=stream))
            assert text.result is not None, text.error
            items = [said, *text.result["items"]]
            tool = await run_call(client, request("openai-chat", url, stream=stream,
                                                  items=items))
            assert tool.result is not None, tool.error
            for out in (text, tool):
                seen = repr((out.partials, out.result))
                assert OPENAI_KEY not in seen, seen
                assert CUSTOM_KEY not in seen, seen
                assert "[REDACTED]" in repr(out.result)
            if stream:
                assert "[REDACTED]" in text.text()
            assert "your key is [REDACTED], and [REDACTED]" in repr(text.result)


def test_redaction_covers_messages_args_and_tracebacks(caplog: pytest.LogCaptureFixture
                                                       ) -> None:
    secret = "sk-unit-test-secret-value-0123456789"
    secrets.install_log_redaction({"SOME_API_KEY": secret})
    log = logging.getLogger("tests.model.redaction")
    with caplog.at_level(logging.DEBUG, logger="tests.model.redaction"):
        log.debug("header authorization: Bearer %s", secret)
        try:
            raise ValueError(f"bad key {secret}")
        except ValueError:
            log.exception("failed")
    text = caplog.text
    assert secret not in text
    assert text.count("[REDACTED]") >= 2


def test_credentials_resolution_order_and_missing_key(tmp_path: Path) -> None:
    route = ModelRoute(name="main", provider="anthropic", model="m",
                       base_url="https://api.anthropic.com")
    creds = secrets.Credentials({"ANTHROPIC_API_KEY": "anthropic-key-123456",
                                 "CORRAL_API_KEY": "corral-key-123456"}, {})
    assert creds.key_for(route) == "corral-key-123456"
    creds = secrets.Credentials({"ANTHROPIC_API_KEY": "anthropic-key-123456"}, {})
    assert creds.key_for(route) == "anthropic-key-123456"
    route["credential_env"] = "TEAM_KEY"
    with pytest.raises(AuthError) as info:
        creds.key_for(route)
    assert "TEAM_KEY" in info.value.message
    assert info.value.retryable is False
    keyfile = tmp_path / "keys.env"
    keyfile.write_text("# keys\nTEAM_KEY='team-key-from-file-123'\n")
    creds = secrets.Credentials({}, secrets.load_credentials_file(keyfile))
    assert creds.key_for(route) == "team-key-from-file-123"
    assert creds.info() == {"credentials_available": []}  # names only, never values
    local = ModelRoute(name="l", provider="openai-chat", model="m",
                       base_url="http://127.0.0.1:8000/v1")
    assert secrets.Credentials({}, {}).key_for(local) is None
