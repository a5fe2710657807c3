"""The specs of outside tools: corral.toml's [mcp.NAME] and [tools.NAME], the
same per session, argument validation, and the broker's refusal to queue a
request for a pinned service no worker serves (no processes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from broker import protocol
from broker.records import Limits, Side
from broker.state import Dispatcher
from supervisor import config
from supervisor.tools import specs
from supervisor.tools.router import Listed
from supervisor.tools.schema import ArgumentsInvalid, SchemaProblem, check_schema, validate


def load(tmp_path: Path, text: str) -> config.FarmConfig:
    (tmp_path / "corral.toml").write_text(text)
    return config.load(tmp_path)


def test_toml_tables_parse(tmp_path: Path) -> None:
    cfg = load(tmp_path, '''
[mcp.git]
command = ["mcp-server-git"]
env = { GIT_AUTHOR_NAME = "corral" }
[mcp.docs]
url = "https://example.invalid/mcp"
headers_env = { Authorization = "CORRAL_MCP_DOCS_TOKEN" }
start_timeout_s = 90
[tools.wc]
description = "Count words"
command = ["wc", "-w"]
parameters = { type = "object", properties = { text = { type = "string" } } }
read_only = true
''')
    assert cfg.mcp["git"] == {"command": ["mcp-server-git"], "network": False,
                              "env": {"GIT_AUTHOR_NAME": "corral"}}
    assert cfg.mcp["docs"]["headers_env"] == {"Authorization": "CORRAL_MCP_DOCS_TOKEN"}
    assert cfg.mcp["docs"]["start_timeout_s"] == 90.0
    assert cfg.command_tools["wc"]["read_only"] is True
    assert cfg.command_tools["wc"]["idempotent"] is False


@pytest.mark.parametrize(("text", "says"), [
    ('[tools.shell]\ndescription = "x"\ncommand = ["x"]', "built-in tool"),
    ('[tools.t]\ndescription = "x"\ncommand = "ls -l"', "[tools.t] command must be a non-empty"),
    ('[tools.t]\ndescription = "x"\ncommand = ["x"]\nparameters = { type = "objekt" }',
     "JSON Schema of an object"),
    ('[tools.t]\ndescription = "x"\ncommand = ["x"]\n'
     'parameters = { type = "object", properties = { a = { type = "strin" } } }',
     "not a valid JSON Schema"),
    ('[tools.t]\ndescription = "x"\ncommand = ["x"]\nidempotent = "yes"', "true or false"),
    ('[mcp.a]\ncommand = ["x"]\nurl = "http://h"', "exactly one of"),
    ('[mcp.a]\nurl = "ftp://h"', "http:// or https://"),
    ('[mcp.a]\nurl = "http://h"\nnetwork = true', "for command (stdio) servers only"),
    ('[mcp.a__b]\ncommand = ["x"]', "without '__'"),
    ('[mcp.a]\ncommand = ["x"]\nstart_timeout_s = 0', "start_timeout_s must be a number"),
    ('[mcp.a]\ncommand = ["x"]\nstart_timeout_s = 301', "at most 300"),
    ('[mcp.a]\ncommand = ["x"]\nstart_timeout_s = "10"', "start_timeout_s must be a number"),
    ('[mcp.a]\ncommand = ["x"]\ncwd = "/etc"', "relative to the workspace"),
    ('[mcp.a]\ncommand = ["x"]\ntransport = "sse"', "unknown key(s) ['transport']"),
    ('[mcp.a]\nurl = "http://h"\nheaders_env = { Authorization = "OPENAI_API_KEY" }',
     "starting CORRAL_MCP_"),
])
def test_bad_tables_say_what_to_fix(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(config.ConfigError) as err:
        load(tmp_path, text)
    assert says in str(err.value)
    assert "corral.toml" in str(err.value)


def test_session_specs_merge_over_the_file_per_name() -> None:
    merged = specs.merged({"a": {"command": ["x"]}, "b": {"command": ["y"]}},
                          {"b": {"command": ["z"]}})
    assert specs.parse_mcp_servers(merged)["b"]["command"] == ["z"]
    with pytest.raises(specs.SpecError):
        specs.parse_command_tools({"read_file": {"description": "d", "command": ["x"]}})


def test_schema_validation() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    validate(schema, {"n": 1})
    with pytest.raises(ArgumentsInvalid, match="at n: 'x' is not of type 'integer'"):
        validate(schema, {"n": "x"})
    with pytest.raises(SchemaProblem):
        check_schema({"type": 3})
    # A remote $ref is never fetched: an error, not a network call.
    with pytest.raises(SchemaProblem, match="Unresolvable"):
        validate({"$ref": "http://example.invalid/s.json"}, {})


def test_a_servers_unusable_tools_are_set_aside() -> None:
    tools: list[Any] = [
        {"name": "ok", "description": "d", "input_schema": {"type": "object"},
         "read_only": True, "idempotent": False},
        {"name": "bad", "description": "d", "input_schema": {"type": "objekt"},
         "read_only": False, "idempotent": False},
        {"name": "has space", "description": "d", "input_schema": {"type": "object"},
         "read_only": False, "idempotent": False},
    ]
    listed = Listed("srv", tools)
    assert list(listed.schemas) == ["mcp__srv__ok"]
    assert listed.schemas["mcp__srv__ok"]["idempotent"]  # read-only: safe to repeat
    assert set(listed.broken) == {"mcp__srv__bad", "mcp__srv__has space"}


def test_broker_never_queues_a_pinned_service_nobody_serves() -> None:
    d = Dispatcher("b" * 16, Limits(), now=0.0)
    client = b"c1"
    out = d.on_client(client, protocol.Request("r1", "tool@dead", 5.0, b"x"), now=0.0)
    failures = [s.msg for s in out if s.side is Side.CLIENT
                and isinstance(s.msg, protocol.FailureReply)]
    assert [(f.kind, f.retryable) for f in failures] == [("unroutable", True)]
    d.check_invariants()
    # A pinned service a worker serves is dispatched as usual.
    d.on_worker(b"w1", protocol.Ready(("tool", "tool@live")), now=0.0)
    out = d.on_client(client, protocol.Request("r2", "tool@live", 5.0, b"x"), now=0.0)
    assert any(s.side is Side.WORKER for s in out)
    d.check_invariants()


def test_approval_rules_glob_tool_names() -> None:
    from supervisor.engine.approvals import Decision, parse_policy

    policy = parse_policy({"default": "ask", "deny": ["mcp__git__*"],
                           "allow": ["mcp__time__get_current_time"]})
    assert policy.decide("mcp__git__git_status", {})[0] is Decision.DENY
    assert policy.decide("mcp__time__get_current_time", {})[0] is Decision.ALLOW
    assert policy.decide("mcp__time__convert_time", {})[0] is Decision.ASK
    assert policy.decide("mcp__gitx__status", {})[0] is Decision.ASK


def test_session_create_options_merge_and_refuse() -> None:
    from supervisor.facade import _outside_options
    from supervisor.server import CallError

    defaults = {"mcp": {"git": {"command": ["g"]}, "time": {"command": ["t"]}},
                "command_tools": {"wc": {"description": "d", "command": ["wc"]}},
                "approval": "ask"}
    spec = _outside_options(defaults, {"mcp": {"time": {"command": ["t2"]}},
                                       "workspace": "/w"})
    assert spec["mcp"]["git"]["command"] == ["g"]
    assert spec["mcp"]["time"]["command"] == ["t2"]
    assert set(spec["command_tools"]) == {"wc"}
    assert "tools" not in spec  # SessionSpec.tools stays the built-ins' list
    assert (spec["approval"], spec["workspace"]) == ("ask", "/w")
    with pytest.raises(CallError, match="built-in tool"):
        _outside_options({}, {"tools": {"shell": {"description": "d", "command": ["x"]}}})
