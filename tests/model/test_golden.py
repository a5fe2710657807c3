"""Golden tests: each adapter's request body for one rich conversation, checked
against the provider's documented format (tests/model/golden/*.json), both as
built and as the scripted provider received it through broker and worker."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from broker.client import BrokerClient
from sandbox_worker.model.http import body_for, headers_for, url_for
from tests.helpers import Procs
from tests.model.golden_request import golden_request
from tests.model.stack import PROVIDERS, Stacks, recorded, run_call, start_fake, stats

# One shared broker+worker stack per worker-option set (conftest.py's
# ``stacks``), also under xdist (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("model-golden")

GOLDEN = Path(__file__).parent / "golden"
FILES = {"openai-responses": "responses.json", "openai-chat": "chat.json",
         "anthropic": "anthropic.json"}


def golden(provider: str) -> dict[str, Any]:
    return json.loads((GOLDEN / FILES[provider]).read_text())  # type: ignore[no-any-return]


def keys(obj: Any) -> set[str]:
    if isinstance(obj, dict):
        return set(obj) | {k for v in obj.values() for k in keys(v)}
    if isinstance(obj, list):
        return {k for v in obj for k in keys(v)}
    return set()


@pytest.mark.parametrize("provider", PROVIDERS)
def test_request_body_matches_golden(provider: str) -> None:
    body = body_for(golden_request(provider), True)  # type: ignore[arg-type]
    assert body == golden(provider)
    assert "corral" not in keys(body)


def test_urls_and_headers_per_provider() -> None:
    anthropic = golden_request("anthropic", "https://api.anthropic.com/v1/")
    assert url_for(anthropic) == "https://api.anthropic.com/v1/messages"  # type: ignore[arg-type]
    headers = headers_for(anthropic, "k" * 20, 2, True)  # type: ignore[arg-type]
    assert headers["x-api-key"] == "k" * 20
    assert headers["anthropic-version"] == "2023-06-01"
    assert "authorization" not in headers
    assert headers["x-corral-attempt"] == "2"
    chat = golden_request("openai-chat", "https://api.openai.com/v1")
    assert url_for(chat) == "https://api.openai.com/v1/chat/completions"  # type: ignore[arg-type]
    assert headers_for(chat, "k" * 20, 1, False)[  # type: ignore[arg-type]
        "authorization"] == "Bearer " + "k" * 20
    responses = golden_request("openai-responses", "https://api.openai.com/v1")
    assert url_for(responses) == "https://api.openai.com/v1/responses"  # type: ignore[arg-type]
    responses["op"] = "compact"
    assert url_for(responses) == (  # type: ignore[arg-type]
        "https://api.openai.com/v1/responses/compact")


def test_anthropic_keeps_at_most_four_cache_breakpoints() -> None:
    req = golden_request("anthropic")
    req["items"] = [dict(i, corral={"cache_breakpoint": True}) for i in req["items"]]
    body = body_for(req, True)  # type: ignore[arg-type]
    assert json.dumps(body).count("cache_control") == 4


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_provider_receives_golden_body_through_worker(
        procs: Procs, stacks: Stacks, tmp_path: Path, provider: str) -> None:
    url = start_fake(procs, tmp_path, {"responses": [
        {"text": "unused 0"}, {"text": "unused 1"}, {"text": "listed"}]})
    stack = stacks.get()
    async with BrokerClient(stack.frontend) as client:
        out = await run_call(client, golden_request(provider, url))
    assert out.error is None, out.error
    assert out.text() == "listed"  # k = 2 model outputs in the conversation
    [seen] = recorded(url)
    assert seen["body"] == golden(provider)
    assert stats(url)["by_k"] == {"2": 1}
