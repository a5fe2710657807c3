"""``corral sessions`` and ``corral show`` on a home whose sessions are in PostgreSQL
(``[store] url``), with no farm running here (another host's supervisors own them):
the real CLI reads the shared store, lists every session with its live lease owner
(``--json`` and the table), derives running / suspended from the lease, replays a
session's events, and names an unreachable store's URL without its password."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from supervisor.store import SessionId
from supervisor.store.pg.store import PgStore
from tests.store.steps import Session, new_record, tool_round

pytestmark = pytest.mark.timeout(90)


def corral(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor.cli", *args, "--home", str(home)],
                          capture_output=True, text=True, timeout=60)


async def test_sessions_and_show_read_the_shared_store_with_owners(
        pg_server: Any, tmp_path: Path) -> None:
    url = pg_server.new_database()
    home = tmp_path / "home"
    home.mkdir()
    (home / "corral.toml").write_text(f'[store]\nurl = "{url}"\n')
    owned = await PgStore.open(url, owner="sv-east", lease_s=60)
    try:
        await owned.create_session(new_record("s-owned"))
        s = Session("s-owned")
        s.state.active_turn = {"turn_id": "t1", "phase": "model"}
        await owned.commit(s.step(tool_round(1), events=[("step", {"n": 1})]))
        await owned.create_session(new_record("s-free"))
        await owned.release(SessionId("s-free"))  # nobody owns it now
        done = corral(home, "sessions", "--json")
        assert done.returncode == 0, done.stderr
        listed = {x["session_id"]: x for x in json.loads(done.stdout)["sessions"]}
        assert set(listed) == {"s-owned", "s-free"}
        owner = listed["s-owned"]["owner"]
        assert owner["id"] == "sv-east"
        assert owner["epoch"] == 1
        assert 0 < owner["lease_expires_in_s"] <= 60
        assert listed["s-owned"]["state"] == "running"  # a turn, under a live lease
        assert listed["s-free"]["owner"] is None
        assert listed["s-free"]["state"] == "idle"
        table = corral(home, "sessions")
        assert table.returncode == 0, table.stderr
        assert "OWNER" in table.stdout
        row = next(line for line in table.stdout.splitlines() if "s-owned" in line)
        assert "sv-east" in row
        shown = corral(home, "show", "s-owned", "--json")
        assert shown.returncode == 0, shown.stderr
        events = json.loads(shown.stdout)["events"]
        assert [(e["sequence"], e["type"]) for e in events] == [(1, "step")]
        missing = corral(home, "show", "s-nope")
        assert missing.returncode != 0
        assert "no session 's-nope'" in missing.stderr
        # delete without a farm works on the shared store too
        gone = corral(home, "delete", "s-free", "--yes")
        assert gone.returncode == 0, gone.stderr
        left = json.loads(corral(home, "sessions", "--json").stdout)["sessions"]
        assert [x["session_id"] for x in left] == ["s-owned"]
        assert corral(home, "delete", "s-free", "--yes").returncode != 0  # no such session
    finally:
        await owned.close()
        pg_server.drop_database(url)
    # The database gone: a clear error naming the URL without its password.
    done = corral(home, "sessions")
    assert done.returncode != 0
    assert "cannot read the sessions in PostgreSQL at" in done.stderr
    assert pg_server.password not in done.stderr + done.stdout


@pytest.mark.parametrize("args", [("sessions",), ("sessions", "--json"), ("show", "s-x")])
def test_a_mistyped_store_url_is_an_error_not_an_empty_list(tmp_path: Path,
                                                            args: tuple[str, ...]) -> None:
    """With ``[store] url`` unusable, where the sessions are is unknown: ``corral
    sessions`` and ``show`` say why (the key, no password) and exit 1; they once fell
    back to an absent SQLite file and said "no sessions" with exit 0."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "corral.toml").write_text('[store]\nurl = "mysql://u:s3cr3t-pw@db/corral"\n')
    out = corral(home, *args)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "[store.url]" in out.stdout + out.stderr
    assert "s3cr3t-pw" not in out.stdout + out.stderr
