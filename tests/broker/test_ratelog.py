"""Rate-limited warnings (broker/ratelog.py): one line per key per period, and the
next line says how many it stands for."""

from __future__ import annotations

import logging

import pytest

from broker import ratelog
from broker.ratelog import RateLimitedLog


def test_one_line_per_key_per_period_with_the_count(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    monkeypatch.setattr(ratelog.time, "monotonic", lambda: now[0])
    rl = RateLimitedLog(logging.getLogger("t.ratelog"), 10.0)
    with caplog.at_level(logging.WARNING, logger="t.ratelog"):
        assert rl.warning("down", "store down: %s", "refused")  # the first: at once
        for _ in range(49):
            now[0] += 0.1
            assert not rl.warning("down", "store down: %s", "refused")
        assert rl.warning("other", "lease round skipped")  # another key: its own period
        now[0] = 111.0
        assert rl.warning("down", "store down: %s", "refused")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["store down: refused", "lease round skipped",
                     "store down: refused (50 like this in the last 11 s)"]
