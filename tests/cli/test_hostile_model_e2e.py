"""Bad input from a hostile scripted model, through ``corral run`` as a user
drives it (issue 13, items 5 and 6): floods of output past every cap, huge
arguments, many calls at once, huge model text, lone surrogates, odd file
names, non-finite numbers. Each turn must go on to ``turn_complete``, the
stored results must be within the store's bounds and carry a visible marker
where they were cut, the next prompt must work, and nothing recorded before
may be lost (the journal equals every durable event the runs printed).

One farm per test (``corral up --detach``), one session walked turn by turn
(the scripted provider picks its reply by the model outputs already in the
context). Afterwards the farm is stopped and the store is opened and checked.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandbox_worker.api import STORE_ITEM_BYTES, TOOL_OUTPUT_BYTES, json_size
from supervisor.store import Store
from supervisor.store.records import SessionId
from tests.helpers import PYTHON, REPO, kill_tree

pytestmark = pytest.mark.timeout(420)

TOML = ('[session]\ndefault_route = "s"\napproval = "allow"\n'
        '[routes.s]\nscript = "script.json"\nread_timeout_s = 30.0\n')
INTERNAL_NAMES = ("UnicodeEncodeError", "UnicodeDecodeError", "Traceback", "RecordTooLarge",
                  "Error:")


def call(name: str, arguments: Any, call_id: str | None = None) -> dict[str, Any]:
    c: dict[str, Any] = {"name": name, "arguments": arguments}
    if call_id is not None:
        c["call_id"] = call_id
    return c


def calls(*cs: dict[str, Any]) -> dict[str, Any]:
    return {"tool_calls": list(cs), "usage": {"input": 10, "output": 3}}


def text(t: str) -> dict[str, Any]:
    return {"text": t, "usage": {"input": 10, "output": 3}}


def corral(home: Path | None, *args: str, timeout_s: float = 180) -> tuple[int, str, str]:
    import subprocess

    where = ["--home", str(home)] if home is not None else []
    r = subprocess.run([PYTHON, "-m", "supervisor.cli", *args, *where],
                       capture_output=True, timeout=timeout_s, cwd=REPO,
                       stdin=subprocess.DEVNULL)
    return (r.returncode, r.stdout.decode("utf-8", "replace"),
            r.stderr.decode("utf-8", "replace"))


@pytest.fixture
def farm(workspace_root: Path) -> Iterator[tuple[Path, Path]]:
    """A home and a workspace; the farm started in the test is killed by pid."""
    home = workspace_root / "home"
    home.mkdir()
    (home / "corral.toml").write_text(TOML)
    ws = workspace_root / "ws"
    ws.mkdir()
    ws.chmod(0o777)
    yield home, ws
    try:
        info = json.loads((home / "farm.json").read_text())
    except (OSError, ValueError):
        return
    for child in info.get("children", []):
        if isinstance(child.get("pid"), int):
            kill_tree(child["pid"])
    if isinstance(info.get("root_pid"), int):
        kill_tree(info["root_pid"])


class Walk:
    """One session walked turn by turn through ``corral run --json``."""

    def __init__(self, home: Path, ws: Path) -> None:
        self.home, self.ws = home, ws
        self.sid: str | None = None
        self.durable: list[dict[str, Any]] = []

    def turn(self, prompt: str) -> list[dict[str, Any]]:
        where = ["--session", self.sid] if self.sid else ["--workspace", str(self.ws)]
        rc, out, err = corral(self.home, "run", "--json", *where, prompt)
        events = [json.loads(line) for line in out.splitlines() if line.strip()]
        assert events, err
        self.sid = self.sid or events[0]["session_id"]
        assert events[-1]["type"] == "turn_complete", (prompt, events[-3:], err[-2000:])
        assert rc == 0, err
        self.durable += [e for e in events if e["sequence"] > 0]
        for e in events:
            if e["type"] == "tool_call_end":
                assert not any(n in e["payload"]["output"] for n in INTERNAL_NAMES), e
        return events


def ends(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e["payload"] for e in events if e["type"] == "tool_call_end"]


def stored(home: Path, sid: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every transcript item (all batches, whatever a compaction did to the
    context) and the journal, read back from the store after the farm."""
    async def read() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        store = await Store.open(home / "corral.db")
        try:
            assert await store.load(SessionId(sid)) is not None
            batches: list[list[dict[str, Any]]] = []
            cursor: int | None = None
            while True:
                page = await store.transcript_page(SessionId(sid), before_sequence=cursor,
                                                   max_batches=50)
                batches[:0] = [b.items for b in page.items]
                if page.next_cursor is None or not page.items:
                    break
                cursor = int(page.next_cursor)
            journal = [{"sequence": e.sequence, "type": e.type, "payload": e.payload}
                       for e in await store.replay_events(SessionId(sid))]
            return [i for b in batches for i in b], journal
        finally:
            await store.close()
    return asyncio.run(read())


def check_journal(walk: Walk, journal: list[dict[str, Any]]) -> None:
    """Nothing recorded is lost: the journal is exactly what the runs printed."""
    assert walk.sid is not None
    seen = [(e["sequence"], e["type"]) for e in walk.durable]
    assert [(e["sequence"], e["type"]) for e in journal][:len(seen)] == seen
    assert [e["sequence"] for e in journal] == list(range(1, len(journal) + 1))


def outputs(context: list[dict[str, Any]]) -> dict[str, str]:
    return {i["call_id"]: i["output"] for i in context if i["type"] == "function_call_output"}


def test_floods_and_huge_arguments_are_stored_cut_and_the_turns_go_on(
        farm: tuple[Path, Path]) -> None:
    home, ws = farm
    (ws / "ctl.txt").write_bytes(b"\x01" * 700_000 + b"\n" + b"\xff" * 300_000)
    # Together under the model service's own bound on one stream event (4 MiB).
    huge_new = "Z" * 1_000_000
    (ws / "edit.txt").write_text("old text\n")
    responses = [
        calls(call("shell", {"command": "seq 1 400000"}, "c_seq")),
        text("after seq"),
        calls(call("shell", {"command": "head -c 200000000 /dev/zero | tr '\\0' a"}, "c_200m")),
        text("after 200 MB"),
        calls(call("shell", {"command": "seq 1 400000 & head -c 3000000 /dev/urandom >&2; "
                                        "wait"}, "c_both")),
        text("after both streams"),
        calls(call("shell", {"command": "head -c 3000000 /dev/zero"}, "c_nul")),
        text("after NUL bytes"),
        calls(call("read_file", {"path": "ctl.txt", "limit": 100_000_000}, "c_read")),
        text("after the read"),
        calls(call("write_file", {"path": "big.txt", "content": "W" * 1_500_000}, "c_write"),
              call("edit_file", {"path": "edit.txt", "old": "old", "new": huge_new},
                   "c_edit")),
        text("after huge arguments"),
        calls(*(call("shell", {"command": "head -c 1000000 /dev/zero | tr '\\0' '\"'"},
                     f"c_par{i}") for i in range(6))),
        text("after parallel floods"),
        text('"' * 1_500_000),
        calls(*(call("list_dir", {"path": "."}, f"c_many{i}") for i in range(200))),
        text("after many calls"),
        text("final answer"),
    ]
    (home / "script.json").write_text(json.dumps({"responses": responses}))
    rc, _, err = corral(home, "up", "--detach", "--workers", "2", "--json")
    assert rc == 0, err
    walk = Walk(home, ws)

    for prompt, cid in (("seq", "c_seq"), ("200 MB", "c_200m"), ("both", "c_both"),
                        ("nul", "c_nul")):
        (end,) = ends(walk.turn(prompt))
        assert end["call_id"] == cid
        assert end["truncated"] is True, end
        assert end["outcome"] == "error", end
        assert end.get("error_kind") == "output_limit", end
    (read,) = ends(walk.turn("read"))
    assert read["outcome"] == "ok"
    assert read["truncated"] is True
    writes = {e["call_id"]: e for e in ends(walk.turn("huge arguments"))}
    assert set(writes) == {"c_write", "c_edit"}
    for e in writes.values():
        assert e["is_error"] is True
        assert e["outcome"] == "bad", e
        assert "arguments in all" in e["output"], e
    assert not (ws / "big.txt").exists(), "a refused call must not run"
    assert (ws / "edit.txt").read_text() == "old text\n"
    par = ends(walk.turn("parallel"))
    assert len(par) == 6
    assert all(e["truncated"] for e in par)
    big = walk.turn("huge text")
    (message,) = [e["payload"] for e in big if e["type"] == "agent_message"]
    assert "characters cut" in message["text"]
    many = walk.turn("many calls")
    assert len(ends(many)) == 128
    assert any(e["type"] == "warning" and e["payload"].get("dropped_calls") == 72
               for e in many)
    final = walk.turn("again")
    assert [e["payload"]["text"] for e in final if e["type"] == "agent_message"] == \
        ["final answer"]

    assert walk.sid is not None
    rc, out, err = corral(home, "export", walk.sid, "--out", str(home / "cp.json"), "--json")
    assert rc == 0, err
    rc, out, err = corral(home, "down")
    assert rc == 0, err
    rc, out, _ = corral(None, "verify", str(home / "cp.json"))
    assert rc == 0, out
    assert "ok" in out

    context, journal = stored(home, walk.sid)
    check_journal(walk, journal)
    for item in context:
        assert json_size(item) <= STORE_ITEM_BYTES, (item.get("type"), json_size(item))
    outs = outputs(context)
    for cid in ("c_seq", "c_200m", "c_nul", *(f"c_par{i}" for i in range(6))):
        assert json_size(outs[cid]) <= TOOL_OUTPUT_BYTES
        assert "to fit the stored result" in outs[cid] or "truncated at" in outs[cid], cid
    assert "[stderr]" in outs["c_both"]
    assert "cut to fit the stored result" in outs["c_both"], outs["c_both"][-300:]
    assert "output limit of" in outs["c_both"]  # how the command ended is always kept
    assert "the result is bounded at" in outs["c_read"]
    assert outs["c_seq"].startswith("1\n2\n3\n")
    texts = [p["text"] for i in context if i["type"] == "message" and i["role"] == "assistant"
             for p in i["content"]]
    assert any("cut by Corral to fit the store's bound" in t for t in texts)
    assert sum(i["type"] == "function_call" for i in context) == \
        sum(i["type"] == "function_call_output" for i in context)


def test_odd_encodings_are_handled_and_never_leak_internals(
        farm: tuple[Path, Path]) -> None:
    home, ws = farm
    names = [b"bad\xffname.txt", b"new\nline", b"esc\x1b[31mred", b"back\\slash", b"ok.txt"]
    for n in names:
        with open(os.path.join(os.fsencode(ws), n), "wb") as f:
            f.write(b"x")
    deep = "[" * 100_000 + "]" * 100_000
    responses = [
        calls(call("list_dir", {"path": "."}, "c_list")),
        text("after the listing"),
        calls(call("shell", '{"command": "echo A\\ud800B; echo done"}', "c_cmd"),
              call("read_file", '{"path": "bad\\udcffname.txt"}', "c_read"),
              call("write_file", '{"path": "w\\ud800.txt", "content": "\\udfff"}', "c_write")),
        text("after surrogates in arguments"),
        {"text": "model text \ud800 with a lone surrogate", "reasoning": "why \udcff",
         "usage": {"input": 1, "output": 1}},
        calls(call("sh\ud800ell", {"command": "true"}, "c_\udcff"),
              call("shell", '{"timeout_s": NaN, "command": "true"}', "c_nan"),
              call("shell", '{"timeout_s": 1e999, "command": "true"}', "c_inf"),
              call("shell", deep, "c_deep"),
              call("list_dir", '["not an object"]', "c_list2")),
        text("after odd arguments"),
        text("final answer"),
    ]
    (home / "script.json").write_text(json.dumps({"responses": responses}))
    rc, _, err = corral(home, "up", "--detach", "--workers", "2", "--json")
    assert rc == 0, err
    walk = Walk(home, ws)

    (listing,) = ends(walk.turn("list"))
    assert listing["outcome"] == "ok", listing
    shown = listing["output"]
    assert "bad\\xffname.txt  1 bytes  (name shown escaped" in shown
    assert "new\\x0aline" in shown
    assert "esc\\x1b[31mred" in shown
    assert "back\\slash  1 bytes" in shown  # a clean name is shown as it is
    assert "ok.txt  1 bytes" in shown

    got = {e["call_id"]: e for e in ends(walk.turn("surrogates"))}
    assert got["c_cmd"]["outcome"] == "ok"
    assert "A\ufffdB" in got["c_cmd"]["output"]
    assert got["c_read"]["error_kind"] == "not_found", got["c_read"]
    assert got["c_write"]["outcome"] == "ok", got["c_write"]
    assert (ws / "w\ufffd.txt").read_text() == "\ufffd"

    said = walk.turn("model text")
    (message,) = [e["payload"]["text"] for e in said if e["type"] == "agent_message"]
    assert message == "model text \ufffd with a lone surrogate"

    odd = ends(walk.turn("odd arguments"))
    by_name = {e["call_id"]: e for e in odd}
    assert len(odd) == 5
    assert by_name["c_nan"]["outcome"] == "bad"
    assert "not a JSON number" in by_name["c_nan"]["output"]
    assert by_name["c_inf"]["outcome"] == "bad"
    assert "out of range" in by_name["c_inf"]["output"]
    assert by_name["c_deep"]["outcome"] == "bad"
    assert by_name["c_list2"]["outcome"] == "bad"
    # The wire carries no lone surrogate: the call's id and name arrive with U+FFFD.
    assert by_name["c_\ufffd"]["outcome"] == "missing"
    assert "sh\ufffdell" in by_name["c_\ufffd"]["output"]
    final = walk.turn("again")
    assert [e["payload"]["text"] for e in final if e["type"] == "agent_message"] == \
        ["final answer"]

    assert walk.sid is not None
    rc, out, err = corral(home, "show", walk.sid, "--json")
    assert rc == 0, err
    assert [e["sequence"] for e in json.loads(out)["events"]] == \
        [e["sequence"] for e in walk.durable]
    rc, _, err = corral(home, "export", walk.sid, "--out", str(home / "cp.json"))
    assert rc == 0, err
    rc, _, err = corral(home, "down")
    assert rc == 0, err
    rc, out, _ = corral(None, "verify", str(home / "cp.json"))
    assert rc == 0, out
    context, journal = stored(home, walk.sid)
    check_journal(walk, journal)
    raw = json.dumps(context, ensure_ascii=False)
    assert not any(0xD800 <= ord(c) <= 0xDFFF for c in raw), "a lone surrogate was stored"
    log = (home / "logs").glob("worker-*.log")
    assert not any("Traceback" in p.read_text(errors="replace") for p in log)
