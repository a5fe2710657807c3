"""The ``shell`` tool: one sandboxed command, streamed, bounded, timed.

A string command runs as ``/bin/bash -c COMMAND`` (over an image without
``/bin/bash``, ``/bin/sh -c COMMAND``); a list runs as that argv.
The command runs through the worker's ``Profile`` chain (see
``sandbox/profile.py``) in the workspace (or ``workdir`` beneath it) and
``sandbox/process.py`` streams and bounds it.

Invariants:
- The result always says how the command ended: exit code, or the signal
  that ended the chain's head, or "timeout"/"output limit"; output kept up to
  the moment it ended is returned, with a truncation marker when capped.
- The rendered output fits the store's item bound by construction
  (``render``: at most ``TOOL_OUTPUT_BYTES`` as a JSON string).
- Nothing of the call survives ``run_shell`` (process.run's guarantee), and
  the per-call tmp dir (T1/T0) is removed afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import tempfile
from dataclasses import dataclass
from typing import Any

from sandbox_worker import tracing
from sandbox_worker.api import TOOL_OUTPUT_BYTES, ToolLimits, fit_text, json_size
from sandbox_worker.sandbox.errors import BadArguments, ToolError
from sandbox_worker.sandbox.images import ImageRoot
from sandbox_worker.sandbox.overlay import Layer
from sandbox_worker.sandbox.process import OnChunk, RunOutcome, RunSpec, run
from sandbox_worker.sandbox.profile import Profile, Shape
from sandbox_worker.tools.fsops import check_relative

# Never let a call's wall time run into the broker's deadline: reply first.
REPLY_MARGIN_S = 0.5


@dataclass
class ShellRun:
    outcome: RunOutcome
    wall_s: float
    shape: Shape  # the chain's shape: its isolation record is that shape's probe's


def command_argv(command: Any) -> list[str]:
    if isinstance(command, str):
        if not command.strip():
            raise BadArguments("shell: 'command' is empty")
        return ["/bin/bash", "-c", command]
    if isinstance(command, list) and command and all(isinstance(c, str) for c in command):
        return list(command)
    raise BadArguments("shell: 'command' must be a string or a non-empty list of strings")


def effective_wall_s(args: dict[str, Any], limits: ToolLimits, remaining_s: float) -> float:
    wall = float(limits["wall_s"])
    if "timeout_s" in args:
        wall = min(wall, float(args["timeout_s"]))
    return max(0.05, min(wall, remaining_s - REPLY_MARGIN_S))


async def run_shell(profile: Profile, args: dict[str, Any], workspace: str,
                    limits: ToolLimits, *, network: bool, uid: int, call_id: str,
                    remaining_s: float, on_chunk: OnChunk | None, grace_s: float,
                    workspace_fd: int | None = None, gid: int | None = None,
                    read_only: bool = False, ro_fds: tuple[tuple[int, str], ...] = (),
                    stdin: bytes | None = None, image: ImageRoot | None = None) -> ShellRun:
    """Run one shell call as ``uid`` (the call's own, leased by the caller) and
    ``gid`` (its workspace's group), in the workspace pinned as ``workspace_fd``."""
    argv = command_argv(args["command"])
    if image is not None and isinstance(args["command"], str):
        argv[0] = image.shell  # an image need not have bash
    workdir = check_relative(args.get("workdir", "."))
    wall = effective_wall_s(args, limits, remaining_s)
    tmpdir: str | None = None
    launch = tracing.start("sandbox.launch", tier=str(profile.tier))
    if profile.tier in ("T1", "T0"):
        tmpdir = await asyncio.to_thread(_make_tmp, profile, uid)
    layer: Layer | None = None
    try:
        if image is not None:  # the call's writable layer over the image (overlay.py)
            layer = await profile.image_layer(image, limits, uid, gid)
        return await _run_chain(profile, argv, workspace, limits, network=network, uid=uid,
                                tmpdir=tmpdir, call_id=call_id, workdir=workdir,
                                workspace_fd=workspace_fd, gid=gid, read_only=read_only,
                                ro_fds=ro_fds, image=image, layer=layer, wall=wall,
                                launch=launch, on_chunk=on_chunk, grace_s=grace_s,
                                stdin=stdin)
    except OSError as exc:
        if layer is None and image is not None:
            tracing.end(launch, failed=True)
            raise ToolError(f"the image's root could not be mounted for this call: {exc}",
                            kind="sandbox_unavailable") from None
        raise
    finally:
        if layer is not None:
            # run() returned only once the call's tree is gone.
            await asyncio.to_thread(layer.close)
        if tmpdir is not None:
            await asyncio.to_thread(shutil.rmtree, tmpdir, True)


async def _run_chain(profile: Profile, argv: list[str], workspace: str, limits: ToolLimits, *,
                     network: bool, uid: int, tmpdir: str | None, call_id: str, workdir: str,
                     workspace_fd: int | None, gid: int | None, read_only: bool,
                     ro_fds: tuple[tuple[int, str], ...], image: ImageRoot | None,
                     layer: Layer | None, wall: float, launch: Any,
                     on_chunk: OnChunk | None, grace_s: float, stdin: bytes | None,
                     ) -> ShellRun:
    chain = profile.build(argv, workspace, limits, network=network, uid=uid, tmpdir=tmpdir,
                          call_id=call_id, workdir=workdir, workspace_fd=workspace_fd,
                          gid=gid, read_only=read_only, ro_fds=ro_fds, image=image,
                          layer=layer)
    verified = profile.verified.get(chain.shape)
    try:
        if verified is None:
            # A chain unlike every probed one (e.g. the first network grant):
            # the kernel must show its layers before a tool runs under it.
            shape, verified = await profile.verify_chain(
                workspace, network=network, uid=uid, tmpdir=tmpdir, workdir=workdir,
                workspace_fd=workspace_fd, gid=gid, read_only=read_only, ro_fds=ro_fds,
                image=image)
            if shape != chain.shape:
                raise ToolError("this call's sandbox chain differs from the one probed for it",
                                kind="sandbox_unavailable")
        if verified.problems:
            raise ToolError(f"this call's sandbox did not hold at tier {profile.tier}: "
                            f"{'; '.join(verified.problems)}", kind="sandbox_unavailable")
    except BaseException:
        tracing.end(launch, failed=True)
        for fd in chain.pass_fds:
            os.close(fd)
        raise
    tracing.end(launch)
    spec = RunSpec(argv=chain.argv, env=chain.env, wall_s=wall,
                   output_bytes=int(limits["output_bytes"]), pass_fds=chain.pass_fds,
                   grace_s=grace_s, uid=uid, stdin=stdin)
    try:
        with tracing.span("tool.run", tier=str(profile.tier)):
            outcome = await run(spec, on_chunk)
    finally:
        for fd in chain.pass_fds:
            os.close(fd)
    return ShellRun(outcome, wall, chain.shape)


TMP_PREFIX = "corral-call-"


def _make_tmp(profile: Profile, uid: int) -> str:
    # The worker's pid in the name lets a later worker remove what a killed one
    # left behind (remove_stale_tmp).
    path = tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-", dir=profile.tmp_root)
    os.chown(path, uid, profile.user.gid)
    return path


def remove_stale_tmp(tmp_root: str) -> int:
    """Remove per-call tmp dirs (T1/T0) of workers that no longer run. Blocking."""
    removed = 0
    with contextlib.suppress(OSError):
        for name in os.listdir(tmp_root):
            if not name.startswith(TMP_PREFIX):
                continue
            pid_text = name[len(TMP_PREFIX):].split("-", 1)[0]
            if not pid_text.isdigit():
                continue
            try:
                os.kill(int(pid_text), 0)
                continue  # that worker is alive: its calls own their dirs
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
            shutil.rmtree(os.path.join(tmp_root, name), ignore_errors=True)
            removed += 1
    return removed


def _signame(num: int) -> str:
    with contextlib.suppress(ValueError):
        return signal.Signals(num).name
    return f"signal {num}"


def _share(stdout_size: int, stderr_size: int, room: int) -> tuple[int, int]:
    """Split ``room`` bytes between the two streams: each gets what it needs if
    that is at most half, the other the rest; both over half get half each."""
    half = room // 2
    if stdout_size + stderr_size <= room:
        return stdout_size, stderr_size
    if stderr_size <= half:
        return room - stderr_size, stderr_size
    if stdout_size <= half:
        return stdout_size, room - stdout_size
    return half, room - half


def render(run_: ShellRun, limits: ToolLimits,
           max_bytes: int = TOOL_OUTPUT_BYTES) -> tuple[str, bool]:
    """What the model reads: stdout, stderr apart, and how the command ended;
    and whether anything was cut. Bytes that are not UTF-8 become U+FFFD. The
    text as a JSON string (``json_size``) is at most ``max_bytes`` (the store's
    item bound less the item envelope, see ``sandbox_worker.api``): when the
    two streams do not fit together they share the room (``_share``), each
    cut at its head with a marker; the line saying how the command ended is
    always kept."""
    o = run_.outcome
    cap = int(limits["output_bytes"])
    out = o.stdout.decode("utf-8", errors="replace")
    err = o.stderr.decode("utf-8", errors="replace")
    notes: list[str] = []
    if len(o.stdout) >= cap:
        notes.append(f"\n[... stdout truncated at {cap} bytes]")
    if len(o.stderr) >= cap:
        notes.append(f"\n[... stderr truncated at {cap} bytes]")
    if o.timed_out:
        notes.append(f"\n[timed out after {run_.wall_s:g} s; the command was killed]")
    elif o.flooded:
        notes.append(f"\n[output limit of {cap} bytes per stream reached; "
                     "the command was killed]")
    elif o.signal is not None:
        notes.append(f"\n[killed by {_signame(o.signal)}]")
    elif o.exit_code is not None and o.exit_code > 128 and o.exit_code - 128 < 65:
        notes.append(f"\n[exit code {o.exit_code} (128+{_signame(o.exit_code - 128)}: "
                     "killed by a signal or a limit such as CPU time or file size)]")
    elif o.exit_code:
        notes.append(f"\n[exit code {o.exit_code}]")
    trailer = "".join(notes)
    err_head = "\n[stderr]\n" if err else ""
    # JSON string bodies add up: the room for the two streams is what the
    # quoted trailer and stderr heading leave, less two cut markers.
    room = max_bytes - json_size(trailer + err_head) - 2 * _MARKER_ROOM
    out_size, err_size = json_size(out) - 2, json_size(err) - 2
    cut = False
    if out_size + err_size > room:
        out_room, err_room = _share(out_size, err_size, max(0, room))
        out, cut_out = fit_text(out, out_room + 2 + _MARKER_ROOM, _STDOUT_CUT)
        err, cut_err = fit_text(err, err_room + 2 + _MARKER_ROOM, _STDERR_CUT)
        cut = cut_out or cut_err
    text = (out + err_head + err + trailer).lstrip("\n") or "[no output]"
    # Not reached unless max_bytes is smaller than the trailer: a last bound.
    text, last = fit_text(text, max_bytes, _STDOUT_CUT)
    return text, cut or last


_MARKER_ROOM = 128  # bytes a cut marker may take, at most
_STDOUT_CUT = ("\n[... output cut to fit the stored result: {shown} of {total} bytes "
               "shown]")
_STDERR_CUT = ("\n[... stderr cut to fit the stored result: {shown} of {total} bytes "
               "shown]")
