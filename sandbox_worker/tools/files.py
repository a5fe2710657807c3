"""The file tools: read_file, write_file, edit_file, list_dir.

Each function is blocking and runs in a ``SandboxFS`` executor thread (fs
credentials of the sandbox uid and the workspace's group), resolving every
path with ``openat2`` beneath a duplicate of the worker's pinned workspace fd
(``tools/pinning.py``; see ``fsops``), so the workspace's path is never
resolved again and its parents need not be searchable by the sandbox.

Invariants:
- Reads are bounded by ``read_limit_bytes``; writes and edits by
  ``write_limit_bytes`` (and the call's RLIMIT_FSIZE value); listings by
  ``MAX_LIST_ENTRIES`` (a directory is read as a stream, never held whole).
  Going over a bound is a clear error or a truncated result marked
  ``truncated`` -- never an unbounded allocation.
- Every output is at most ``FileLimits.output_bytes`` as a JSON string (the
  store's item bound less the envelope, ``sandbox_worker.api``), whatever the
  file holds: a read shows whole lines up to it, a listing whole rows.
- File names come from the kernel as bytes; a name that is not UTF-8 (or has
  control characters) is shown escaped and flagged, never passed on raw
  (``fsops.display_name``).
- Writes happen in place on the opened fd (truncate, then write), so the file
  written is the file that was checked; new files are created with mode 0666
  minus the umask (or as the workspace's default ACL says), owned by the
  sandbox uid until the call's sweep gives them to the workspace's owner.
"""

from __future__ import annotations

import heapq
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

from sandbox_worker.api import TOOL_OUTPUT_BYTES, fit_text, json_size
from sandbox_worker.sandbox.errors import BadArguments, EditMismatch, FileProblem
from sandbox_worker.tools.fsops import (
    check_relative,
    display_name,
    make_parents,
    map_oserror,
    open_regular,
    open_workspace,
    openat2,
)

DEFAULT_READ_LINES: Final = 2000
MAX_LIST_ENTRIES: Final = 1000
_MARKER_ROOM: Final = 512  # bytes kept free for a truncation marker


@dataclass
class FileLimits:
    read_limit_bytes: int = 1024 * 1024
    write_limit_bytes: int = 10 * 1024 * 1024
    output_bytes: int = TOOL_OUTPUT_BYTES  # the result's output, as a JSON string


@dataclass
class FileResult:
    output: str
    truncated: bool = False


def _read_all(fd: int, limit: int) -> tuple[bytes, bool]:
    chunks: list[bytes] = []
    total = 0
    while total <= limit:
        data = os.read(fd, min(1 << 20, limit + 1 - total))
        if not data:
            break
        chunks.append(data)
        total += len(data)
    raw = b"".join(chunks)
    return raw[:limit], len(raw) > limit


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def read_file(workspace: int | str, args: dict[str, Any], lim: FileLimits) -> FileResult:
    path = check_relative(args["path"])
    offset = int(args.get("offset", 0))
    max_lines = int(args.get("limit", DEFAULT_READ_LINES))
    wsfd = open_workspace(workspace)
    try:
        fd = open_regular(wsfd, path, os.O_RDONLY)
    finally:
        os.close(wsfd)
    try:
        size = os.fstat(fd).st_size
        raw, cut = _read_all(fd, lim.read_limit_bytes)
    except OSError as exc:
        raise map_oserror(exc, path) from exc
    finally:
        os.close(fd)
    if b"\0" in raw[:8192]:
        raise FileProblem(f"{path} looks binary ({size} bytes); read it with the shell tool "
                          "(e.g. xxd | head)", kind="binary_file")
    lines = raw.decode("utf-8", errors="replace").splitlines(keepends=True)
    chosen = lines[offset: offset + max_lines]
    text = "".join(chosen)
    # The output bound (U+FFFD and JSON escapes can make the text several times
    # the bytes read): whole lines, as many as fit with the marker.
    room = lim.output_bytes - _MARKER_ROOM
    over = json_size(text) > room
    if over:
        head, _ = fit_text(text, room, "")
        # Whole lines of the head (a prefix of the chosen lines, the last maybe cut).
        parts = head.splitlines(keepends=True)
        keep = sum(1 for i, part in enumerate(parts) if part == chosen[i])
        text = "".join(chosen[:keep]) if keep else head
        chosen = chosen[:keep] if keep else chosen[:1]
    truncated = cut or over or offset + max_lines < len(lines)
    if truncated:
        shown_to = offset + len(chosen)
        more = (f"file is {size} bytes; read stopped at {lim.read_limit_bytes} bytes"
                if cut else f"{len(lines)} lines in total")
        if over:
            more += f"; the result is bounded at {lim.output_bytes} bytes"
        text += (f"\n[... truncated: showed lines {offset}-{shown_to - 1}"
                 f"{' (the last one cut)' if over and not keep else ''}; {more}; "
                 f"use offset/limit to read more]")
    return FileResult(text, truncated)


def _check_size(content: bytes, lim: FileLimits, fsize: int) -> None:
    _check_length(len(content), lim, fsize)


def _check_length(length: int, lim: FileLimits, fsize: int) -> None:
    top = min(lim.write_limit_bytes, fsize)
    if length > top:
        raise FileProblem(f"content is {length} bytes; the limit is {top}", kind="too_large")


def write_file(workspace: int | str, args: dict[str, Any], lim: FileLimits, fsize: int,
               ) -> FileResult:
    path = check_relative(args["path"])
    if path == ".":
        raise BadArguments("write_file: 'path' must name a file")
    content = args["content"].encode("utf-8", errors="surrogatepass")
    _check_size(content, lim, fsize)
    wsfd = open_workspace(workspace)
    try:
        make_parents(wsfd, path)
        # No O_TRUNC at open: the hard-link check happens before any change.
        fd = open_regular(wsfd, path, os.O_WRONLY | os.O_CREAT)
    finally:
        os.close(wsfd)
    try:
        os.ftruncate(fd, 0)
        _write_all(fd, content)
    except OSError as exc:
        raise map_oserror(exc, path) from exc
    finally:
        os.close(fd)
    return FileResult(f"wrote {len(content)} bytes to {path}")


def edit_file(workspace: int | str, args: dict[str, Any], lim: FileLimits, fsize: int,
              ) -> FileResult:
    path = check_relative(args["path"])
    old: str = args["old"]
    new: str = args["new"]
    count = args.get("count")
    wsfd = open_workspace(workspace)
    try:
        fd = open_regular(wsfd, path, os.O_RDWR)
    finally:
        os.close(wsfd)
    try:
        raw, cut = _read_all(fd, lim.write_limit_bytes)
        if cut:
            raise FileProblem(f"{path} is larger than {lim.write_limit_bytes} bytes; "
                              "edit it with the shell tool", kind="too_large")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FileProblem(f"{path} is not UTF-8 text", kind="not_utf8") from exc
        found = text.count(old)
        if found == 0:
            raise EditMismatch(f"'old' text not found in {path}", kind="old_not_found")
        if count is None and found > 1:
            raise EditMismatch(f"'old' text occurs {found} times in {path}; give more "
                               "context or set 'count'", kind="old_ambiguous")
        if count is not None and found < count:
            raise EditMismatch(f"'old' text occurs {found} times in {path}, fewer than "
                               f"count={count}", kind="old_not_found")
        n = 1 if count is None else int(count)
        # The result's size before making it: a 1 MB file of "a", old "a", new
        # 2,000 characters and count 1,000,000 asked for 2 GB, and the worker
        # went silent building it (the broker declared it lost).
        grow = len(new.encode("utf-8", "surrogatepass")) - len(old.encode("utf-8",
                                                                            "surrogatepass"))
        _check_length(len(raw) + n * grow, lim, fsize)
        updated = text.replace(old, new, n).encode("utf-8", "surrogatepass")
        _check_size(updated, lim, fsize)
        os.lseek(fd, 0, os.SEEK_SET)
        os.ftruncate(fd, 0)
        _write_all(fd, updated)
    except OSError as exc:
        raise map_oserror(exc, path) from exc
    finally:
        os.close(fd)
    return FileResult(f"replaced {n} occurrence{'s' if n != 1 else ''} in {path}")


def _first_names(dfd: int, count: int) -> tuple[int, list[str]]:
    """How many entries the directory ``dfd`` has, and the first ``count``
    names in sorted order, read as a stream (a directory of millions of
    entries costs the worker ``count`` names of memory, not millions)."""
    total = 0

    def names() -> Iterator[str]:
        nonlocal total
        with os.scandir(dfd) as it:
            for entry in it:
                total += 1
                yield entry.name

    first = heapq.nsmallest(count, names())
    return total, first


def list_dir(workspace: int | str, args: dict[str, Any], lim: FileLimits | None = None,
             ) -> FileResult:
    path = check_relative(args.get("path", "."))
    wsfd = open_workspace(workspace)
    try:
        try:
            dfd = openat2(wsfd, path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise map_oserror(exc, path) from exc
    finally:
        os.close(wsfd)
    room = (lim or FileLimits()).output_bytes - _MARKER_ROOM
    used = 2
    try:
        total, names = _first_names(dfd, MAX_LIST_ENTRIES)
        rows: list[str] = []
        for name in names:
            # A name that is not clean UTF-8 text is shown escaped (display_name).
            shown, odd = display_name(name)
            note = "  (name shown escaped: not UTF-8 or has control characters)" if odd else ""
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except OSError:
                row = f"{shown}  (vanished)"
            else:
                if stat.S_ISDIR(st.st_mode):
                    row = f"{shown}/"
                elif stat.S_ISLNK(st.st_mode):
                    try:
                        target, _ = display_name(os.readlink(name, dir_fd=dfd))
                    except OSError:
                        target = "?"
                    row = f"{shown} -> {target}  (symlink, not followed by file tools)"
                elif stat.S_ISREG(st.st_mode):
                    row = f"{shown}  {st.st_size} bytes"
                else:
                    row = f"{shown}  (special file)"
            size = json_size(row + note) - 1  # its JSON body and the newline
            if used + size > room:
                break
            used += size
            rows.append(row + note)
    except OSError as exc:
        raise map_oserror(exc, path) from exc
    finally:
        os.close(dfd)
    truncated = total > len(rows)
    if truncated:
        rows.append(f"[... {total - len(rows)} more entries not shown]")
    if not rows:
        rows.append("(empty directory)")
    return FileResult("\n".join(rows), truncated)
