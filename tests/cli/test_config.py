"""corral.toml parsing: defaults, validation with readable errors, routes."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.config import ConfigError, load, write_default


def test_the_default_file_loads_to_the_defaults(tmp_path: Path) -> None:
    write_default(tmp_path, env={})
    cfg = load(tmp_path)
    assert cfg.tier_min == "T2"
    assert cfg.approval == "ask"
    assert cfg.limits["output_bytes"] == 1048576
    assert set(cfg.routes) == {"main"}  # the scripted demo: no key in the environment
    assert cfg.routes["main"]["script"] == str(tmp_path / "demo-script.json")
    assert not cfg.allow_unsandboxed


def test_a_missing_file_means_defaults(tmp_path: Path) -> None:
    cfg = load(tmp_path)
    assert cfg.heartbeat_interval_s == 0.25
    assert cfg.liveness == 4


def test_routes_provider_and_script(tmp_path: Path) -> None:
    (tmp_path / "s.json").write_text('{"responses": []}')
    (tmp_path / "corral.toml").write_text(
        '[routes.main]\nprovider = "openai-chat"\nmodel = "qwen"\n'
        'base_url = "http://127.0.0.1:8000/v1"\n'
        '[routes.offline]\nscript = "s.json"\n')
    cfg = load(tmp_path)
    assert cfg.routes["main"]["provider"] == "openai-chat"
    assert cfg.routes["main"]["name"] == "main"
    assert cfg.routes["offline"]["script"] == str(tmp_path / "s.json")


@pytest.mark.parametrize(("text", "needle"), [
    ("[farm]\nworkerz = 2\n", "workerz"),
    ("[sandbox]\ntier_min = 'T9'\n", "tier_min"),
    ("[session]\napproval = 'maybe'\n", "approval"),
    ("[routes.x]\nprovider = 'nope'\nmodel = 'm'\nbase_url = 'http://x'\n", "provider"),
    ("[routes.x]\nprovider = 'anthropic'\n", "model"),
    ("[farm]\nworkers = 'two'\n", "workers"),
    ("not toml at all [", "not valid TOML"),
    ("[[export.sinks]]\ntype = 's3'\n", "export.sinks"),
])
def test_invalid_configs_name_the_key(tmp_path: Path, text: str, needle: str) -> None:
    (tmp_path / "corral.toml").write_text(text)
    with pytest.raises(ConfigError, match=needle):
        load(tmp_path)


def test_sandbox_mode_and_git_writable_reach_the_session_policy(tmp_path: Path) -> None:
    from supervisor.main import session_defaults

    write_default(tmp_path)
    assert "sandbox_mode" not in session_defaults(load(tmp_path))["tool_policy"]
    (tmp_path / "corral.toml").write_text('[sandbox]\nmode = "read-only"\ngit_writable = true\n')
    policy = session_defaults(load(tmp_path))["tool_policy"]
    assert policy["sandbox_mode"] == "read-only"
    assert policy["git_writable"] is True
    (tmp_path / "corral.toml").write_text('[sandbox]\nmode = "yolo"\n')
    with pytest.raises(ConfigError, match=r"sandbox\.mode"):
        load(tmp_path)


@pytest.mark.parametrize(("text", "needle"), [
    ("[farm]\nworkers = 2\n\n[sandbox.limits]\nwall_s = -1\n",
     "line 5: [sandbox.limits.wall_s] must not be negative"),
    ("[session]\nturn_timeout_s = 0\n", "line 2: [session.turn_timeout_s] must be above 0"),
    ("[farm]\nheartbeat_interval_s = -0.5\n", "line 2: [farm.heartbeat_interval_s] must be "
     "above 0"),
    ('[routes."my route"]\nprovider = "anthropic"\nmodl = "m"\n',
     "line 3: [routes.my route] unknown key(s) ['modl'] (did you mean 'model'?)"),
    ("[sesion]\napproval = 'ask'\n", "line 1: [top level] unknown key(s) ['sesion'] "
     "(did you mean 'session'?)"),
    ("farm.workers = 'x'\n", "line 1: [farm.workers] must be an integer"),
    ("[farm]\nworkers = 1\n[mcp.git]\ncommand = ['x']\ntransport = 'sse'\n",
     "line 3: [mcp.git] unknown key(s) ['transport']"),
    ("[[hooks.pre_tool]]\ncommand = 'x'\n[[hooks.pre_tool]]\ncommand = 'y'\ntimeout_s = 0\n",
     "[hooks.pre_tool[1].timeout_s] must be above 0"),
])
def test_errors_name_the_line_and_suggest(tmp_path: Path, text: str, needle: str) -> None:
    (tmp_path / "corral.toml").write_text(text)
    with pytest.raises(ConfigError) as caught:
        load(tmp_path)
    assert needle in str(caught.value)
    assert str(caught.value).startswith(f"{tmp_path / 'corral.toml'}, line ")
