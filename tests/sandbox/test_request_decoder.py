"""``sandbox_worker.api.decode_tool_request``: the one check of a ``tool``
REQUEST's envelope, used by the tool service (``ToolService._parse``). Pure and
fast: every malformed shape is a ``MalformedRequest`` naming the field; what
the arguments and the policy mean stays the tool service's (a tool error)."""

from __future__ import annotations

from typing import Any

import pytest

from sandbox_worker.api import MalformedRequest, ToolCallRequest, decode_tool_request

GOOD: dict[str, Any] = {"call_id": "c1", "tool": "shell", "arguments": {"command": "true"},
                        "session_id": "s1", "workspace": "/w"}


def test_a_well_formed_request_is_returned_typed() -> None:
    req: ToolCallRequest = decode_tool_request(dict(GOOD))
    assert req == GOOD
    pinned = {**GOOD, "workspace_identity": [2049, 77], "workspace_host": "h1",
              "policy": {"network": True}}
    assert decode_tool_request(pinned) == pinned


@pytest.mark.parametrize(("body", "names"), [
    ([1, 2], "must be a map"),
    (None, "must be a map"),
    (b"raw", "must be a map"),
    ({k: v for k, v in GOOD.items() if k != "call_id"}, "'call_id' must be a string"),
    ({**GOOD, "tool": 7}, "'tool' must be a string"),
    ({**GOOD, "session_id": None}, "'session_id' must be a string"),
    ({**GOOD, "workspace": ["/w"]}, "'workspace' must be a string"),
    ({k: v for k, v in GOOD.items() if k != "arguments"}, "lacks 'arguments'"),
    ({**GOOD, "workspace_identity": [1]}, "'workspace_identity'"),
    ({**GOOD, "workspace_identity": [1, -2]}, "'workspace_identity'"),
    ({**GOOD, "workspace_identity": [True, 2]}, "'workspace_identity'"),
    ({**GOOD, "workspace_identity": "1:2"}, "'workspace_identity'"),
    ({**GOOD, "workspace_host": 3}, "'workspace_host' must be a string"),
])
def test_a_malformed_request_is_a_typed_error_naming_the_field(body: Any, names: str) -> None:
    with pytest.raises(MalformedRequest) as info:
        decode_tool_request(body)
    assert names in str(info.value)


@pytest.mark.parametrize("body", [
    {**GOOD, "arguments": "not a map"},  # the tool's schema: bad_arguments, read by the model
    {**GOOD, "policy": "not a map"},  # the policy's meaning: a tool error too
    {**GOOD, "tool": "teleport"},  # an unknown tool: unknown_tool
])
def test_what_the_tool_service_judges_passes_the_envelope(body: dict[str, Any]) -> None:
    assert decode_tool_request(body) is body
