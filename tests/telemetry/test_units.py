"""The small pure parts of telemetry: bounded labels, the traceparent parser,
and the [telemetry]/[web] config keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker import otel
from supervisor import config as config_mod
from supervisor.telemetry.labels import OTHER, Bounded
from supervisor.telemetry.setup import split_host_port

pytestmark = pytest.mark.timeout(30)


def test_bounded_labels_cap_distinct_values() -> None:
    b = Bounded(3, max_chars=8)
    assert [b(x) for x in ("a", "b", "c")] == ["a", "b", "c"]
    assert b("d") == OTHER
    assert b("a") == "a"
    assert Bounded(2)("bad label\n{x}") == "bad_label__x_"
    assert Bounded(2, max_chars=4)("abcdefgh") == "abcd"
    assert Bounded(2)(None) == "none"


def test_traceparent_is_parsed_strictly() -> None:
    tp = otel.format_traceparent(0xABC, 0xDEF)
    assert otel.parse_traceparent(tp) == (0xABC, 0xDEF, 1)
    for bad in (None, 5, "", tp + "x", tp.upper(), "01" + tp[2:],
                otel.format_traceparent(0, 1), otel.format_traceparent(1, 0),
                "00-" + "g" * 32 + "-" + "1" * 16 + "-01", "x" * 10_000):
        assert otel.parse_traceparent(bad) is None, bad


def test_host_port() -> None:
    assert split_host_port("127.0.0.1:0") == ("127.0.0.1", 0)
    assert split_host_port("[::1]:9464") == ("::1", 9464)
    for bad in ("9464", ":9464", "host:", "host:99999", "host:x"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            split_host_port(bad)


def test_telemetry_config(tmp_path: Path) -> None:
    (tmp_path / "corral.toml").write_text(
        '[telemetry]\nmetrics_listen = "127.0.0.1:9464"\n'
        'otlp_endpoint = "http://collector:4318"\nrecord_content = true\n'
        '[web]\nlisten = "0.0.0.0:8765"\n')
    cfg = config_mod.load(tmp_path)
    assert cfg.metrics_listen == "127.0.0.1:9464"
    assert cfg.otlp_endpoint == "http://collector:4318"
    assert cfg.record_content is True
    assert cfg.web_listen == "0.0.0.0:8765"
    assert config_mod.load(tmp_path / "none").metrics_listen is None
    for text, where in (('[telemetry]\nmetrics_listen = "9464"\n', "metrics_listen"),
                        ('[telemetry]\notlp_endpoint = "collector"\n', "otlp_endpoint"),
                        ('[telemetry]\nbogus = 1\n', "unknown key"),
                        ('[web]\nlisten = 8765\n', "web.listen")):
        (tmp_path / "corral.toml").write_text(text)
        with pytest.raises(config_mod.ConfigError, match=where):
            config_mod.load(tmp_path)
