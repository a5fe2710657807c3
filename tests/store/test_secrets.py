"""Secrets stay out of the database files: credential-named fields are redacted, and
``scan_db_bytes`` sees whatever did reach the main file or the WAL."""

from __future__ import annotations

import os
from pathlib import Path

from supervisor.store import REDACTED, EventRecord, StepWrite, Store, scan_db_bytes
from supervisor.store.scan import db_files
from tests.store.steps import Session, new_record, tool_round


def _size(path: str) -> int:
    return os.stat(path).st_size


async def test_scan_sees_bytes_in_the_wal_and_after_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "corral.db"
    store = await Store.open(path)
    try:
        s = Session("s1")
        await store.create_session(new_record("s1"))
        items = tool_round(1)
        items[0]["content"][0]["text"] = 'a "quoted" marker-7f3a\nwith a newline'
        await store.commit(s.step(items))
        # Not yet checkpointed: the bytes are in the -wal file only.
        assert _size(f"{path}-wal") > 0
        found = scan_db_bytes(path, ["marker-7f3a", 'a "quoted" marker-7f3a\nwith', "absent-9z"])
        assert found == ["marker-7f3a", 'a "quoted" marker-7f3a\nwith']
    finally:
        await store.close()
    # Closing the last connection checkpointed the WAL into the main file and removed it.
    assert [p.name for p in db_files(path)] == ["corral.db"]
    assert scan_db_bytes(path, ["marker-7f3a", "absent-9z"]) == ["marker-7f3a"]


async def test_credential_named_fields_never_reach_the_files(tmp_path: Path) -> None:
    path = tmp_path / "corral.db"
    secrets = ["sk-live-0123456789", "Bearer abcdef-777", "hunter2-pw", "cfg-key-555"]
    store = await Store.open(path)
    try:
        s = Session("s1")
        await store.create_session(new_record("s1", api_key="cfg-key-555"))
        items = tool_round(1)
        items[1]["corral"] = {"headers": {"Authorization": "Bearer abcdef-777"}}
        step = s.step(items, events=[("model_request", {"route": {"API-Key": "sk-live-0123456789"},
                                                        "nested": [{"password": "hunter2-pw"}]})])
        await store.commit(step)
        loaded = await store.load(s.id)
        assert loaded is not None
        assert loaded.record.config["api_key"] == REDACTED
        assert loaded.context[1]["corral"]["headers"]["Authorization"] == REDACTED
        (event,) = await store.replay_events(s.id)
        assert event.payload == {"route": {"API-Key": REDACTED},
                                 "nested": [{"password": REDACTED}]}
        # Plain text that merely mentions a key name is not touched.
        await store.commit(StepWrite(s.id, events=[
            EventRecord(s.id, 2, "note", {"text": "set api_key in your env"})]))
        assert (await store.replay_events(s.id))[-1].payload["text"] == "set api_key in your env"
    finally:
        await store.close()
    assert scan_db_bytes(path, secrets) == []
