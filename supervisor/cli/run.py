"""``corral run``: submit one user turn and stream its events.

Without a farm at HOME, ``run`` starts a temporary one inside this process.
It writes ``HOME/farm.json`` (``"temporary": true``) while it lives, so
``approve``, ``interrupt``, ``show`` and ``sessions`` reach it from another
shell; its store stays in HOME so ``--session ID`` continues later. A
``script:PATH`` model route gets a scripted provider started for the run.

Approvals: at a terminal the run asks (y/a/n/x). Without one it prints the
command that answers; with a temporary farm (which stops with the run) it
then exits at once with code 4: the request stays recorded and
``corral run --session ID`` (no PROMPT) at a terminal shows it and asks.

Ctrl-C interrupts the turn (as Codex does): the run asks the farm to
interrupt it, shows the ``turn_aborted`` and exits 130. A second Ctrl-C
leaves at once and says what became of the turn.

The config and farm modules (which load the engine) are imported when a run
starts, not with the parser.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from argparse import Namespace
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from supervisor.cli.common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_NEEDS_APPROVAL,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    Subparsers,
    add_home,
    add_json,
    bounded,
    workers_arg,
)
from supervisor.cli.lifecycle import ensure_config
from supervisor.cli.reach import live_endpoint
from supervisor.cli.render import Renderer, clean

if TYPE_CHECKING:
    from supervisor.client import SupervisorClient

TERMINAL = ("turn_complete", "turn_aborted")



def add_parsers(sub: Subparsers) -> None:
    p = sub.add_parser("run", help="submit one user turn and stream its events",
                       description="Submit PROMPT as one user turn and stream the events. "
                       "Without a running farm at HOME a temporary one runs for the run "
                       "(reachable by approve, interrupt, show and sessions while it lives); "
                       "its store stays in HOME so --session ID continues later. With "
                       "--session and no PROMPT it attaches to the session's running turn "
                       "and asks for its pending approval. Ctrl-C interrupts the turn "
                       "(a second Ctrl-C leaves at once). Exits 0 on turn_complete, 1 on "
                       "abort or failure, 4 when an approval is needed and there is no "
                       "terminal to ask, 130 after Ctrl-C.")
    add_home(p)
    p.add_argument("prompt", nargs="?", default=None,
                   help="the user's message; - reads it from stdin to its end (for long "
                   "prompts: one argument holds at most 128 KiB), e.g. corral run - < "
                   "task.md (optional with --session: attach)")
    p.add_argument("--session", default=None, help="continue this session")
    p.add_argument("--model", default=None,
                   help="route name from corral.toml, PROVIDER:MODEL (openai-responses, "
                   "openai-chat, anthropic) or script:PATH")
    p.add_argument("--base-url", default=None, help="base URL for a PROVIDER:MODEL route")
    p.add_argument("--workspace", type=Path, default=None,
                   help="the directory tools work in (default: the current directory)")
    p.add_argument("--approval", default=None, choices=["ask", "allow", "deny"],
                   help="approval policy for tool calls (default: from corral.toml)")
    p.add_argument("--sandbox", default=None, choices=["read-only", "workspace-write"],
                   help="a new session's sandbox mode: read-only binds the workspace "
                   "read-only (default: workspace-write; network is a separate grant)")
    p.add_argument("--allow-git-write", action="store_true",
                   help="a new session's tools may write .git in the workspace (its config "
                   "and hooks run on the host; read-only by default); recorded")
    p.add_argument("--image", default=None, metavar="REF",
                   help="a new session's tools run over this image's root (NAME[:TAG], "
                   "sha256:HEX or NAME@sha256:HEX; import it first with 'corral image "
                   "import'); resolved to its digest now, refused now if missing")
    p.add_argument("--workers", type=workers_arg, default=None,
                   help="workers of a temporary farm (default 2)")
    p.add_argument("--timeout-s", type=bounded(float, 0, above=True), default=1800.0,
                   help="stop following the turn after this many seconds (default 1800; "
                   "exit 1, the turn goes on in the farm)")
    add_json(p)
    p.set_defaults(handler=run_turn)


class RunRefused(Exception):
    """The run cannot start as asked; the message says what to do instead."""


@dataclass
class FarmHandle:
    endpoint: str
    temporary: bool


@contextlib.asynccontextmanager
async def farm_for(home: Path, workers: int | None, say: Any) -> AsyncIterator[FarmHandle]:
    """The farm at ``home``, or a temporary one for the duration (reachable through
    its farm.json while it lives)."""
    from supervisor import config as config_mod
    from supervisor.farm.root import Farm, running_farm

    info = running_farm(home)
    if info is not None:
        if info.get("temporary"):
            raise RunRefused(
                f"the farm at {home} is the temporary farm of another 'corral run' (pid "
                f"{info.get('root_pid')}) and stops when it ends; wait for it, or keep a farm "
                f"up for both: corral up --home {home} --detach")
        yield FarmHandle(await live_endpoint(home), temporary=False)
        return
    ensure_config(home, say)
    cfg = config_mod.load(home)
    if workers is None:
        workers = 2 if cfg.workers is None else cfg.workers
    if workers == 0 and not cfg.backend_tcp:
        raise RunRefused("a temporary farm with no local worker could never run a model or "
                         "tool call: no remote worker can reach it without [farm] backend_tcp "
                         "in corral.toml; drop --workers 0, or start a lasting farm for "
                         "remote workers (corral up --workers 0 --detach)")
    farm = Farm(home, workers=workers, temporary=True)
    say(f"no farm at {home}; starting a temporary one ({len(farm.specs)} processes) "
        "for this run")
    async with farm.started():
        try:
            yield FarmHandle(farm.paths.supervisor_endpoint, temporary=True)
        finally:
            say("stopping the temporary farm")


@contextlib.asynccontextmanager
async def scripted_provider(script: Path, home: Path) -> AsyncIterator[str]:
    """Run a scripted provider for the duration; yields its URL."""
    from supervisor.farm.layout import FarmPaths
    from supervisor.farm.tree import ChildSpec, SupervisionTree

    spec = ChildSpec("fakellm-run", [sys.executable, "-m", "sandbox_worker.fakellm",
                                     "--script", str(script), "--port", "0"],
                     restart="temporary")
    tree = SupervisionTree([spec], log_dir=FarmPaths.of(home).logs)
    await tree.start()
    try:
        yield str(tree.children["fakellm-run"].ready["url"])
    finally:
        await tree.stop()


def _leaf(exc: BaseException) -> BaseException:
    """The one error inside (nested) exception groups of the ephemeral farm's
    task group, so a refusal prints as one line; the group itself otherwise."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def run_turn(ns: Namespace) -> int:
    """``corral run``: the handler (it, not the parser, imports the client and the
    farm: ``corral --help`` stays light)."""
    from supervisor.client import SupervisorError
    from supervisor.config import ConfigError
    from supervisor.farm.tree import FarmError

    if ns.prompt is None and ns.session is None:
        _fail(ns, "usage", "give a PROMPT, - to read it from stdin, or --session ID to "
              "attach to a session's running turn")
        return EXIT_USAGE
    if ns.prompt == "-":
        problem = prompt_from_stdin(ns)
        if problem is not None:
            _fail(ns, "usage", problem)
            return EXIT_USAGE
    if ns.session is None and ns.workspace is not None and not ns.workspace.is_dir():
        # Said before a temporary farm starts (it started, then the supervisor refused).
        what = "is not a directory" if ns.workspace.exists() else "does not exist"
        _fail(ns, "usage", f"workspace {ns.workspace} {what}; create it or choose another "
              "directory")
        return EXIT_USAGE
    if ns.session is not None and not known_session(ns.home, ns.session):
        # Said before a temporary farm starts (it started, then the supervisor refused).
        _fail(ns, "unknown_session", f"no session {ns.session!r} in {ns.home}; list them "
              "with: corral sessions")
        return EXIT_FAILED
    too_long = None if ns.prompt is None else prompt_too_long(ns.prompt)
    if too_long is not None:
        # Refused here, before a farm starts and a session is made for it.
        _fail(ns, "usage", too_long)
        return EXIT_USAGE
    try:
        try:
            return asyncio.run(_run(ns))
        except BaseExceptionGroup as group:
            raise _leaf(group) from None
    except (ConfigError, RunRefused) as exc:
        _fail(ns, "usage", str(exc))
        return EXIT_USAGE
    except FarmError as exc:
        _fail(ns, "start_failed", f"could not start: {exc}")
        return EXIT_USAGE
    except SupervisorError as exc:
        _fail(ns, exc.kind, exc.message)
        return EXIT_UNAVAILABLE if exc.kind == "unavailable" else EXIT_FAILED
    except TimeoutError:
        _fail(ns, "timeout", f"the turn did not end within {ns.timeout_s:.0f}s; it goes on in "
              f"the farm: corral show {ns.session or 'SESSION'}")
        return EXIT_FAILED


def prompt_from_stdin(ns: Namespace) -> str | None:
    """``corral run -``: the prompt is stdin to its end (one trailing newline dropped);
    approvals are then never asked at the terminal (stdin is spent). Returns what is
    wrong with it, or None."""
    data = sys.stdin.buffer.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"the prompt on stdin is not UTF-8 text (byte {data[exc.start]:#04x} at " \
               f"offset {exc.start})"
    text = text.removesuffix("\n")
    if not text.strip():
        return "the prompt on stdin is empty; give the text, e.g. corral run - < task.md"
    ns.prompt, ns.stdin_spent = text, True
    return None


def known_session(home: Path, session_id: str) -> bool:
    """False only when no farm runs at ``home`` and its store surely lacks the
    session; anything unclear (a store it cannot read here) is left to the farm."""
    import sqlite3

    from supervisor.cli.sessions import session_exists
    from supervisor.cli.summary import StoreUnreadable
    from supervisor.config import ConfigError
    from supervisor.farm.root import running_farm

    if running_farm(home) is not None:
        return True
    try:
        return session_exists(home, session_id)
    except (ConfigError, StoreUnreadable, OSError, sqlite3.Error):
        return True


def prompt_too_long(prompt: str) -> str | None:
    """What the farm would refuse in a prompt's size (the op's character bound, and
    the quarter of the session's state row that queued input may use, in bytes of
    stored JSON; docs/storage.md), said before a farm starts; None if it fits."""
    from supervisor.engine.ops import MAX_TEXT_CHARS
    from supervisor.store.codec import Limits

    room = Limits().max_state_bytes // 4 - 512  # the entry's other fields
    size = len(json.dumps(prompt))
    if len(prompt) <= MAX_TEXT_CHARS and size <= room:
        return None
    return (f"the prompt is {size:,} bytes as stored; a session takes at most {room:,} "
            "bytes of input at a time: put the material in a file in the workspace and "
            "ask for it to be read")


def _fail(ns: Namespace, kind: str, message: str) -> None:
    if ns.json:
        # One line of the run's event stream (type cli_error), and the error document
        # every other command prints ({"ok": false, "error": {kind, message}}).
        sys.stdout.write(json.dumps({"type": "cli_error", "kind": kind, "message": message,
                                     "ok": False,
                                     "error": {"kind": kind, "message": message}},
                                    sort_keys=True) + "\n")
        sys.stdout.flush()
    else:
        print(f"corral: {clean(message)} ({kind})", file=sys.stderr)


async def _script_route(model: str, ns: Namespace, stack: contextlib.AsyncExitStack
                        ) -> dict[str, Any]:
    """``--model PROVIDER:MODEL`` or ``script:PATH`` as an inline route (a script gets
    its provider started for the run; a bad script fails here, in one line)."""
    from sandbox_worker.api import parse_route

    try:
        route = parse_route(model, ns.base_url, name=model)
    except ValueError as exc:
        raise RunRefused(str(exc)) from None
    if route.get("script"):
        script = await asyncio.to_thread(Path(str(route["script"])).resolve)
        if not await asyncio.to_thread(script.is_file):
            raise RunRefused(f"script {script} does not exist")
        route["script"] = str(script)
        route["base_url"] = await stack.enter_async_context(scripted_provider(script, ns.home))
    return dict(route)


async def _run(ns: Namespace) -> int:
    from sandbox_worker.api import parse_route
    from supervisor.client import SupervisorClient

    def say(msg: str) -> None:
        if not ns.json:
            print(f"corral: {clean(msg)}", file=sys.stderr)

    route_spec: dict[str, Any] | None = None
    model = ns.model
    async with contextlib.AsyncExitStack() as stack:
        if model and ":" in model:
            route_spec = await _script_route(model, ns, stack)
        farm = await stack.enter_async_context(farm_for(ns.home, ns.workers, say))
        sv = await stack.enter_async_context(SupervisorClient(farm.endpoint))
        if ns.session and not model:
            # A session on a script: route outlives the provider an earlier run
            # started for it; start one again for this run.
            described = await sv.describe(ns.session)
            current = str(described.get("route") or "")
            if current.startswith("script:"):
                route = parse_route(current, None, name=current)
                script = Path(str(route.get("script", "")))
                if await asyncio.to_thread(script.is_file):
                    route["base_url"] = await stack.enter_async_context(
                        scripted_provider(script, ns.home))
                    model, route_spec = current, dict(route)
        run = TurnRun(ns, sv, farm, say)
        async with asyncio.timeout(ns.timeout_s):
            return await run.drive(model, route_spec)
    return EXIT_FAILED  # pragma: no cover - the stack re-raises


def session_spec(ns: Namespace, model: str | None,
                 route_spec: dict[str, Any] | None) -> dict[str, Any]:
    """The ``create_session`` spec of a new session from the run's options."""
    spec: dict[str, Any] = {"workspace": str((ns.workspace or Path.cwd()).resolve())}
    if route_spec is not None:
        spec["route_spec"] = route_spec
    elif model:
        spec["route"] = model
    if ns.approval:
        spec["approval"] = ns.approval
    if getattr(ns, "sandbox", None):
        spec["sandbox_mode"] = ns.sandbox
    if getattr(ns, "allow_git_write", False):
        spec["git_writable"] = True
    if getattr(ns, "image", None):
        spec["image"] = ns.image
    return spec


@dataclass
class TurnRun:
    """One ``corral run``: follows the session's events until the turn it watches
    ends, answers approvals, and turns Ctrl-C into an interrupt."""

    ns: Namespace
    sv: SupervisorClient
    farm: FarmHandle
    say: Callable[[str], None]
    session: str = ""
    target: str | None = None  # the submission whose turn we follow
    asked: set[str] = field(default_factory=set)
    interrupts: int = 0
    interrupt_sent: bool = False
    interrupted: asyncio.Event = field(default_factory=asyncio.Event)

    async def drive(self, model: str | None, route_spec: dict[str, Any] | None) -> int:
        ns, sv = self.ns, self.sv
        pending_id: str | None = None
        if ns.session is None:
            self.session = await sv.create_session(**session_spec(ns, model, route_spec))
            self.say(f"session {self.session}")
            after = live_from = 0
        else:
            self.session = ns.session
            described = await sv.describe(self.session)
            if described.get("status") == "closed":
                raise RunRefused(f"session {self.session} is terminated; it takes no more "
                                 "turns (its history: corral show "
                                 f"{self.session})")
            after = live_from = int(described.get("last_event_sequence", 0))
            active = described.get("active_turn") or {}
            pending_id = (described.get("pending_approval") or {}).get("id")
            if active.get("submission_id"):
                # Show the running turn from its start, with its pending approval.
                after = min(after, max(0, int(active.get("first_sequence") or 1) - 1))
                self.target = str(active["submission_id"])
            if route_spec is not None or model:
                await sv.submit(self.session, {"type": "set_model", "route": model,
                                               **({"route_spec": route_spec}
                                                  if route_spec else {})})
            if ns.prompt is None and self.target is None:
                self.say(f"session {self.session} has no running turn; start one with: "
                         f"corral run --session {self.session} \"PROMPT\"")
                return EXIT_OK
            if self.target is not None and pending_id is None:
                self.say(f"attached to the running turn of session {self.session}")
        if ns.prompt is not None:
            self.target = await sv.submit(self.session, {"type": "user_input",
                                                         "text": ns.prompt})
        return await self._follow(after, live_from, pending_id)

    async def _follow(self, after: int, live_from: int, pending_id: str | None) -> int:
        """Render events after ``after``; approval requests after ``live_from`` (or the
        one pending at attach) are asked for, older ones were answered already."""
        from supervisor.client import SupervisorError

        ns = self.ns
        renderer = None if ns.json else Renderer(sys.stdout)
        interactive = (sys.stdin.isatty() and not ns.json
                       and not getattr(ns, "stdin_spent", False))
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        asks: set[asyncio.Task[None]] = set()

        def on_sigint() -> None:
            self.interrupts += 1
            if self.interrupts == 1:
                self.interrupted.set()
                t = loop.create_task(self._interrupt())
                asks.add(t)
                t.add_done_callback(asks.discard)
            elif me is not None:
                me.cancel()

        loop.add_signal_handler(signal.SIGINT, on_sigint)
        try:
            async for event in self.sv.events(self.session, after_sequence=after):
                if ns.json:
                    sys.stdout.write(json.dumps(event, sort_keys=True, default=str) + "\n")
                    sys.stdout.flush()
                elif renderer is not None:
                    renderer.render(event)
                etype = event.get("type")
                payload = event.get("payload") or {}
                if etype == "exec_approval_request":
                    aid = str(payload.get("id"))
                    fresh = int(event.get("sequence") or 0) > live_from or aid == pending_id
                    if fresh and aid not in self.asked:
                        self.asked.add(aid)
                        if interactive and renderer is not None:
                            t = loop.create_task(self._ask(aid, renderer))
                            asks.add(t)
                            t.add_done_callback(asks.discard)
                        else:
                            code = self._cannot_ask(aid)
                            if code is not None:
                                return code
                if event.get("submission_id") == self.target and etype in TERMINAL:
                    if self.interrupted.is_set():
                        self.say("interrupted the turn (Ctrl-C)")
                        return EXIT_INTERRUPTED
                    return EXIT_OK if etype == "turn_complete" else EXIT_FAILED
            return EXIT_FAILED
        except asyncio.CancelledError:
            if self.interrupts < 2:
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            self._detached()
            return EXIT_INTERRUPTED
        finally:
            loop.remove_signal_handler(signal.SIGINT)
            for t in list(asks):
                t.cancel()
            for t in list(asks):
                with contextlib.suppress(asyncio.CancelledError, SupervisorError):
                    await t

    def _detached(self) -> None:
        if self.interrupt_sent and not self.farm.temporary:
            self.say(f"left at once (second Ctrl-C); the turn was asked to stop: corral show "
                     f"{self.session}")
        elif self.farm.temporary:
            self.say(f"left at once (second Ctrl-C); the temporary farm stops now, so the "
                     f"turn is suspended and resumes when a farm starts: corral run --session "
                     f"{self.session} (no prompt) follows it")
        else:
            self.say(f"detached (second Ctrl-C); the turn goes on in the farm: corral "
                     f"interrupt {self.session}")

    def _cannot_ask(self, approval_id: str) -> int | None:
        """An approval and no terminal: say how to answer; with a temporary farm (it
        stops with us) exit now instead of waiting for an answer nobody can give."""
        answer = (f"corral approve {self.session} {approval_id} "
                  "--decision approved|approved_for_session|denied|abort")
        if not self.farm.temporary:
            if not self.ns.json:
                self.say(f"answer with: {answer}")
            return None
        message = (f"approval {approval_id} needed and there is no terminal to ask. The "
                   f"request stays recorded: answer it at a terminal with: corral run "
                   f"--home {self.ns.home} --session {self.session} (no prompt); or keep a "
                   f"farm up (corral up --detach) and use: {answer}; or run with --approval "
                   "allow|deny")
        _fail(self.ns, "needs_approval", message)
        return EXIT_NEEDS_APPROVAL

    async def _interrupt(self) -> None:
        """Ctrl-C: interrupt the turn we follow (or say why not)."""
        from supervisor.client import SupervisorError

        self.say("interrupting the turn (Ctrl-C again leaves at once)")
        try:
            described = await self.sv.describe(self.session)
            turn = described.get("active_turn") or {}
            if not turn.get("turn_id"):
                self.say("no turn is running yet (Ctrl-C again leaves)")
                return
            if self.target is not None and turn.get("submission_id") != self.target:
                # Never interrupt another client's turn: ours waits behind it.
                self.say("this run's input waits behind another turn, which is left alone "
                         "(Ctrl-C again leaves; corral interrupt "
                         f"{self.session} stops that turn)")
                return
            await self.sv.submit(self.session, {"type": "interrupt",
                                                "turn_id": turn["turn_id"]})
            self.interrupt_sent = True
        except SupervisorError as exc:
            self.say(f"could not interrupt: {exc.message}")

    async def _ask(self, approval_id: str, renderer: Renderer) -> None:
        from supervisor.client import SupervisorError

        decision = await ask_line(renderer)
        if decision is None:
            return
        try:
            await self.sv.submit(self.session, {"type": "exec_approval", "id": approval_id,
                                                "decision": decision})
        except SupervisorError as exc:
            self.say(f"could not answer approval {approval_id}: {exc.message}")


_CHOICES = {"y": "approved", "a": "approved_for_session", "n": "denied", "x": "abort"}
_PROMPT = "approve? [y]es / [a]lways this session / [n]o / abort turn [x]: "


async def ask_line(renderer: Renderer) -> str | None:
    """Ask at the terminal until a valid answer (None at end of input). Reads stdin
    with the event loop (no thread left blocked in input() when the turn ends)."""
    loop = asyncio.get_running_loop()
    fd = sys.stdin.fileno()
    while True:
        renderer.prompt(_PROMPT)
        line = await _read_line(loop, fd)
        if line is None:
            return None
        answer = line.strip().lower()[:1]
        if answer in _CHOICES:
            return _CHOICES[answer]


async def _read_line(loop: asyncio.AbstractEventLoop, fd: int) -> str | None:
    got: asyncio.Future[bytes] = loop.create_future()
    buf = bytearray()

    def readable() -> None:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            return
        except OSError as exc:
            if not got.done():
                got.set_exception(exc)
            return
        buf.extend(chunk)
        if (not chunk or b"\n" in buf) and not got.done():
            got.set_result(bytes(buf))

    loop.add_reader(fd, readable)
    try:
        data = await got
    finally:
        loop.remove_reader(fd)
    return data.decode("utf-8", "replace") if data else None
