"""The tool output bound and the file-name policy, without a sandbox (pure).

The worker's output bound and the store's item bound agree by construction
(``sandbox_worker.api``): any rendered output is at most ``TOOL_OUTPUT_BYTES``
as the store encodes it, whatever bytes the command wrote. Property-tested
with Hypothesis over arbitrary bytes (invalid UTF-8, NUL and other control
characters, quotes: the encodings that grow most).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox_worker.api import (
    ITEM_ENVELOPE_BYTES,
    MAX_CALL_ID_CHARS,
    STORE_ITEM_BYTES,
    TOOL_OUTPUT_BYTES,
    ToolCallResult,
    fit_text,
    json_size,
    json_text,
)
from sandbox_worker.sandbox.process import RunOutcome
from sandbox_worker.tools import files
from sandbox_worker.tools.fsops import display_name
from sandbox_worker.tools.service import bounded
from sandbox_worker.tools.shell import ShellRun, render

MARKER = "\n[... cut: {shown} of {total} bytes shown]"
# Text that grows most when encoded: controls (6 bytes), quotes, U+FFFD, astral,
# lone surrogates (escaped, 6 bytes).
nasty_text = st.text(alphabet=st.sampled_from(
    ["a", "\n", "\x00", "\x01", '"', "\\", "\ufffd", "é", "\U0001f600", "\ud800", "\udcff"]))
nasty_bytes = st.binary(max_size=4096) | st.builds(
    lambda unit, n: unit * n, st.sampled_from([b"\x00", b"\xff", b'"', b"\n", b"a\xc3"]),
    st.integers(0, 3000))


def test_the_output_bound_leaves_room_for_the_item_envelope() -> None:
    # The largest function_call_output item the engine builds: a call_id of
    # MAX_CALL_ID_CHARS characters that each take 6 bytes, is_error set.
    item = {"type": "function_call_output", "call_id": "\x01" * MAX_CALL_ID_CHARS,
            "output": "", "is_error": True}
    assert json_size(item) - 2 + TOOL_OUTPUT_BYTES <= STORE_ITEM_BYTES
    assert TOOL_OUTPUT_BYTES + ITEM_ENVELOPE_BYTES == STORE_ITEM_BYTES


@given(nasty_text, st.integers(0, 400))
@settings(max_examples=300, deadline=None)
def test_fit_text_never_exceeds_its_bound(text: str, max_bytes: int) -> None:
    out, cut = fit_text(text, max_bytes, MARKER)
    if not cut:
        assert out == text
        assert json_size(text) <= max_bytes
    else:
        assert json_size(out) <= max(max_bytes, 2)
        if max_bytes >= 80:  # room for the marker: the head of the text, then it
            head, _, _ = out.partition("\n[... cut:")
            assert text.startswith(head)
            assert out.endswith(" bytes shown]")


def test_a_long_text_is_measured_and_cleaned_in_short_passes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Cutting a huge output (a 50 MB client tool result) runs in a thread; each C
    pass over the text holds the GIL, so none may cover more than one chunk, or the
    event loop's thread (a program's heartbeats) stalls for the whole text: a pass
    covers one chunk, or the shown head (bounded by the output bound, not by the
    input). The chunked result is the one a single pass gives."""
    from sandbox_worker import api

    unit = "ab\x01\"\ud800\U0001f600é\n"
    text = unit * 1_000_000  # 8 M characters
    longest: list[int] = []
    body = api._body_size
    monkeypatch.setattr(api, "_body_size", lambda t: longest.append(len(t)) or body(t))
    out, cut = fit_text(api.replace_surrogates(text), TOOL_OUTPUT_BYTES, MARKER)
    assert cut
    assert max(longest) <= max(api._CHUNK, TOOL_OUTPUT_BYTES) < len(text) // 4
    cleaned = api.SURROGATES.sub("\ufffd", text)
    assert api.replace_surrogates(text) == cleaned
    total = len(json.dumps(cleaned, ensure_ascii=False).encode()) - 2
    assert out.endswith(f"of {total} bytes shown]")
    assert json_size(out) <= TOOL_OUTPUT_BYTES


@given(nasty_text)
@settings(max_examples=200, deadline=None)
def test_json_text_is_valid_utf8_and_reads_back(text: str) -> None:
    encoded, size = json_text({"k": text})
    raw = encoded.encode("utf-8")  # never raises: lone surrogates are escaped
    assert len(raw) == size
    back = json.loads(raw)["k"]
    # A high and a low surrogate given as two code points read back as the one
    # character they encode; everything else reads back exactly.
    assert back.encode("utf-16", "surrogatepass") == text.encode("utf-16", "surrogatepass")


def _run(stdout: bytes, stderr: bytes, *, exit_code: int | None = 0, flooded: bool = False,
         timed_out: bool = False) -> ShellRun:
    outcome = RunOutcome(exit_code=exit_code, signal=None, timed_out=timed_out,
                         flooded=flooded, stdout=stdout, stderr=stderr,
                         stdout_bytes=len(stdout), stderr_bytes=len(stderr),
                         truncated=flooded, duration_s=0.1)
    return ShellRun(outcome, 1.0, ())


@given(nasty_bytes, nasty_bytes, st.integers(1000, 20_000), st.booleans())
@settings(max_examples=200, deadline=None)
def test_render_fits_any_output_and_always_says_how_it_ended(
        out: bytes, err: bytes, max_bytes: int, flooded: bool) -> None:
    limits = {"output_bytes": 1 << 20}
    text, cut = render(_run(out, err, exit_code=None if flooded else 3, flooded=flooded),
                       limits, max_bytes)  # type: ignore[arg-type]
    assert json_size(text) <= max_bytes
    assert ("output limit of" if flooded else "[exit code 3]") in text
    if err:
        assert "[stderr]" in text
    if cut:
        assert "cut to fit the stored result" in text


def test_render_of_a_flood_at_the_default_bound_fits_the_store() -> None:
    # The figure: 1 MiB of stdout was stored as 1,048,766 bytes.
    for unit in (b"1\n", b"\x00", b"\xff", b'"'):
        run = _run(unit * (1 << 20), unit * (1 << 20), exit_code=None, flooded=True)
        text, cut = render(run, {"output_bytes": 1 << 20})  # type: ignore[arg-type]
        assert cut
        assert json_size(text) <= TOOL_OUTPUT_BYTES
        item = {"type": "function_call_output", "call_id": "c" * MAX_CALL_ID_CHARS,
                "output": text, "is_error": True}
        assert json_size(item) <= STORE_ITEM_BYTES
        assert "stdout cut" not in text or "[stderr]" in text  # both streams are shown


def test_bounded_caps_any_result_and_replaces_lone_surrogates() -> None:
    result = ToolCallResult(call_id="c", tool="shell", outcome="error", is_error=True,
                            output="\ud800" + "\x00" * (1 << 20), exit_code=None,
                            signal=None, duration_s=0.0, stdout_bytes=0, stderr_bytes=0,
                            truncated=False, isolation={})  # type: ignore[typeddict-item]
    out = bounded(result)
    assert json_size(out["output"]) <= TOOL_OUTPUT_BYTES
    assert out["truncated"] is True
    assert out["output"].startswith("\ufffd")
    out["output"].encode("utf-8")
    small = dict(result, output="fine")
    assert bounded(small) is small  # type: ignore[arg-type]


names = st.binary(min_size=1, max_size=40).filter(lambda b: b"/" not in b and b"\0" not in b)


@given(names, names)
@settings(max_examples=300, deadline=None)
def test_display_name_is_utf8_text_and_unambiguous(a: bytes, b: bytes) -> None:
    shown_a, odd_a = display_name(os.fsdecode(a))
    shown_b, _ = display_name(os.fsdecode(b))
    shown_a.encode("utf-8")  # never a lone surrogate
    assert not any(ord(c) < 0x20 or ord(c) == 0x7F for c in shown_a)
    if not odd_a:
        assert shown_a == os.fsdecode(a)  # clean names are shown as they are
    if a != b and odd_a and shown_b != os.fsdecode(b):
        assert shown_a != shown_b


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    return tmp_path


def test_read_file_output_is_bounded_whatever_the_file_holds(ws: Path) -> None:
    (ws / "ctl.txt").write_bytes((b"\x01" * 1000 + b"\n") * 900 + b"\xff" * 100_000)
    lim = files.FileLimits(output_bytes=200_000)
    res = files.read_file(str(ws), {"path": "ctl.txt", "limit": 10**9}, lim)
    assert res.truncated
    assert json_size(res.output) <= 200_000
    assert "the result is bounded at 200000 bytes" in res.output
    assert res.output.startswith("\x01" * 1000 + "\n")
    one_line = files.read_file(str(ws / ".."), {"path": f"{ws.name}/ctl.txt"},
                               files.FileLimits(output_bytes=3000))
    assert json_size(one_line.output) <= 3000
    assert "(the last one cut)" in one_line.output


def test_list_dir_escapes_odd_names_and_is_bounded(ws: Path) -> None:
    raw = os.fsencode(ws)
    for name in (b"bad\xffname", b"new\nline", b"plain", b"back\\slash"):
        with open(os.path.join(raw, name), "wb"):
            pass
    out = files.list_dir(str(ws), {"path": "."}).output
    out.encode("utf-8")
    assert "bad\\xffname  0 bytes  (name shown escaped" in out
    assert "new\\x0aline" in out
    assert "back\\slash  0 bytes\n" in out
    for i in range(300):
        (ws / (f"{i:03d}" + "\x01" * 200)).touch()
    small = files.list_dir(str(ws), {"path": "."}, files.FileLimits(output_bytes=20_000))
    assert small.truncated
    assert json_size(small.output) <= 20_000
    assert "more entries not shown" in small.output
