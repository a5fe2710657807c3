"""``corral run``: submit one user turn and stream its events; and ``corral import``.

Without a farm at HOME, ``run`` starts an ephemeral one inside this process
(the embedded default), whose store stays in HOME so ``--session ID`` can
continue the session later. A ``script:PATH`` model route gets a scripted
provider started for the run.

Approval requests are answered at the terminal when stdin is one; otherwise
the command to answer them is printed and the run keeps waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from argparse import Namespace
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from sandbox_worker.api import parse_route
from supervisor.cli import EXIT_FAILED, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE
from supervisor.cli_render import Renderer
from supervisor.client import SupervisorClient, SupervisorError
from supervisor.config import ConfigError
from supervisor.farm.layout import FarmPaths
from supervisor.farm.root import Farm, running_farm
from supervisor.farm.tree import ChildSpec, SupervisionTree

TERMINAL = ("turn_complete", "turn_aborted")


@contextlib.asynccontextmanager
async def farm_for(home: Path, workers: int | None, say: Any) -> AsyncIterator[str]:
    """Yield the supervisor endpoint of the farm at ``home``, starting an
    ephemeral one for the duration when none runs."""
    if running_farm(home) is not None:
        yield FarmPaths.of(home).supervisor_endpoint
        return
    farm = Farm(home, workers=workers or 2)
    say(f"no farm at {home}; starting an ephemeral one ({len(farm.specs)} processes)")
    ready = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(farm.tree.run(on_ready=ready.set))
        waiter = tg.create_task(ready.wait())
        done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            waiter.cancel()
            task.result()  # raises the start-up failure
        try:
            yield farm.paths.supervisor_endpoint
        finally:
            say("stopping the ephemeral farm")
            task.cancel()


@contextlib.asynccontextmanager
async def scripted_provider(script: Path, home: Path) -> AsyncIterator[str]:
    """Run a scripted provider for the duration; yields its URL."""
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
    try:
        try:
            return asyncio.run(_run(ns))
        except BaseExceptionGroup as group:
            raise _leaf(group) from None
    except ConfigError as exc:
        print(f"corral: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except SupervisorError as exc:
        _fail(ns, exc.kind, exc.message)
        return EXIT_UNAVAILABLE if exc.kind == "unavailable" else EXIT_FAILED
    except TimeoutError:
        _fail(ns, "timeout", f"the turn did not end within {ns.timeout_s:.0f}s; it goes on in "
              f"the farm: corral show {ns.session or 'SESSION'}")
        return EXIT_FAILED


def _fail(ns: Namespace, kind: str, message: str) -> None:
    if ns.json:
        sys.stdout.write(json.dumps({"type": "cli_error", "kind": kind,
                                     "message": message}) + "\n")
    else:
        print(f"corral: {message} ({kind})", file=sys.stderr)


async def _run(ns: Namespace) -> int:
    def say(msg: str) -> None:
        if not ns.json:
            print(f"corral: {msg}", file=sys.stderr)

    route_spec: dict[str, Any] | None = None
    model = ns.model
    async with contextlib.AsyncExitStack() as stack:
        if model and ":" in model:
            try:
                route = parse_route(model, ns.base_url, name=model)
            except ValueError as exc:
                print(f"corral: {exc}", file=sys.stderr)
                return EXIT_USAGE
            if route.get("script"):
                script = await asyncio.to_thread(Path(str(route["script"])).resolve)
                if not await asyncio.to_thread(script.is_file):
                    print(f"corral: script {script} does not exist", file=sys.stderr)
                    return EXIT_USAGE
                route["script"] = str(script)
                route["base_url"] = await stack.enter_async_context(
                    scripted_provider(script, ns.home))
            route_spec = dict(route)
        endpoint = await stack.enter_async_context(farm_for(ns.home, ns.workers, say))
        sv = await stack.enter_async_context(SupervisorClient(endpoint))
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
        async with asyncio.timeout(ns.timeout_s):
            return await _drive(ns, sv, model, route_spec, say)
    return EXIT_FAILED  # pragma: no cover - the stack re-raises


async def _drive(ns: Namespace, sv: SupervisorClient, model: str | None,
                 route_spec: dict[str, Any] | None, say: Any) -> int:
    session = ns.session
    if session is None:
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
        session = await sv.create_session(**spec)
        say(f"session {session}")
        after = 0
    else:
        described = await sv.describe(session)
        after = int(described.get("last_event_sequence", 0))
        if route_spec is not None or model:
            await sv.submit(session, {"type": "set_model",
                                      "route": model, **({"route_spec": route_spec}
                                                         if route_spec else {})})
    submission = await sv.submit(session, {"type": "user_input", "text": ns.prompt})
    renderer = None if ns.json else Renderer(sys.stdout)
    interactive = sys.stdin.isatty() and not ns.json
    async for event in sv.events(session, after_sequence=after):
        if ns.json:
            sys.stdout.write(json.dumps(event, sort_keys=True, default=str) + "\n")
            sys.stdout.flush()
        elif renderer is not None:
            renderer.render(event)
        if event.get("submission_id") != submission:
            continue
        etype = event.get("type")
        payload = event.get("payload", {})
        if etype == "exec_approval_request":
            if interactive:
                decision = await _ask(payload)
                await sv.submit(session, {"type": "exec_approval", "id": payload.get("id"),
                                          "decision": decision})
            elif not ns.json:
                say(f"answer with: corral approve {session} {payload.get('id')} "
                    f"--decision approved|approved_for_session|denied|abort")
        if etype in TERMINAL:
            return EXIT_OK if etype == "turn_complete" else EXIT_FAILED
    return EXIT_FAILED


async def _ask(payload: dict[str, Any]) -> str:
    choices = {"y": "approved", "a": "approved_for_session", "n": "denied", "x": "abort"}
    prompt = "approve? [y]es / [a]lways this session / [n]o / abort turn [x]: "
    while True:
        answer = (await asyncio.to_thread(input, prompt)).strip().lower()[:1]
        if answer in choices:
            return choices[answer]


def import_spec(ns: Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The session config an import creates in the farm at HOME (its corral.toml
    defaults, route, workspace, ``--approval``) and the capability binding that
    config gives the session; raises ``ConfigError`` saying what is wrong."""
    from supervisor import config as config_mod
    from supervisor.engine.config import SessionSpec
    from supervisor.engine.tooling import tool_schemas
    from supervisor.export import capability_binding
    from supervisor.facade import pin_workspace
    from supervisor.main import session_defaults
    from supervisor.server import CallError

    home: Path = ns.home.resolve()
    config_mod.write_default(home)
    cfg = config_mod.load(home)
    routes = set(cfg.routes)
    with contextlib.suppress(OSError, ValueError, AttributeError):
        routes |= set(json.loads((home / "routes.json").read_text()))
    route = ns.model or cfg.default_route
    if route not in routes:
        raise ConfigError(f"unknown model route {route!r}; routes of this farm: "
                          f"{sorted(routes)} (add one to {home / 'corral.toml'} or pass --model)")
    workspace = (ns.workspace or Path.cwd()).resolve()
    if not workspace.is_dir():
        raise ConfigError(f"workspace {workspace} is not a directory; create it or pass "
                          "--workspace")
    try:  # the checks and the identity pin create_session makes
        real, extra = pin_workspace(str(workspace), home)
    except CallError as exc:
        raise ConfigError(exc.message) from None
    values: dict[str, Any] = {**session_defaults(cfg), "workspace": real, "route": route}
    if ns.approval:
        values["approval"] = ns.approval
    spec = SessionSpec(**values)
    spec.extra = {**spec.extra, **extra}
    binding = capability_binding(tool_schemas(spec.tools),
                                 {"approval": spec.approval,
                                  "tool_policy": dict(spec.tool_policy)})
    return spec.to_config(), binding


def _binding_difference(doc: dict[str, Any], expected: dict[str, Any]) -> str:
    try:
        have = doc["content"]["logical_resume"]["capability_binding"]
        parts = []
        mine = {t["name"]: t["schema_digest"] for t in expected["tools"]}
        theirs = {t["name"]: t["schema_digest"] for t in have["tools"]}
        if mine != theirs:
            changed = sorted(n for n in set(mine) | set(theirs) if mine.get(n) != theirs.get(n))
            parts.append(f"tools differ ({', '.join(changed)})")
        if have.get("policy_digest") != expected.get("policy_digest"):
            parts.append("the approval/tool policy differs")
        return "; ".join(parts) or "the binding differs"
    except (KeyError, TypeError):
        return "the binding is malformed"


def import_checkpoint(ns: Namespace) -> int:
    from supervisor.export import BindingMismatch, CheckpointInvalid
    from supervisor.export import import_checkpoint as do_import
    from supervisor.facade import check_workspace
    from supervisor.server import CallError
    from supervisor.store import SessionId, Store, StoreError
    from supervisor.store.errors import SessionExists

    try:
        doc = json.loads(ns.file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        print(f"corral: cannot read {ns.file}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if running_farm(ns.home) is not None:
        print(f"corral: stop the farm first (corral down --home {ns.home}): the supervisor "
              "is the store's only writer", file=sys.stderr)
        return EXIT_USAGE
    try:
        config, binding = import_spec(ns)
    except ConfigError as exc:
        print(f"corral: {exc}", file=sys.stderr)
        return EXIT_USAGE

    async def go() -> str:
        paths = FarmPaths.of(ns.home)
        paths.prepare()
        store = await Store.open(paths.db)
        try:
            wanted = ns.session or doc.get("descriptor", {}).get("session_id")
            if isinstance(wanted, str) and await store.get_session(SessionId(wanted)):
                raise SessionExists(f"session {wanted} already exists in {ns.home}")
            await check_workspace(store, str(config["workspace"]), None)
            record = await do_import(store, doc, expected_binding=binding,
                                     new_session_id=ns.session, config=config)
            return str(record.session_id)
        finally:
            await store.close()

    try:
        session = asyncio.run(go())
    except CheckpointInvalid as exc:
        print(f"corral: import refused: {exc}; see every problem with: corral verify "
              f"{ns.file}", file=sys.stderr)
        return EXIT_FAILED
    except BindingMismatch:
        print(f"corral: import refused: the checkpoint was made with other capabilities than "
              f"this farm would give the session: {_binding_difference(doc, binding)}. A "
              "checkpoint never resumes under other tools or policy: import it into a farm "
              "with the same [session]/[sandbox] settings in corral.toml, or pass the "
              "--approval the session ran with", file=sys.stderr)
        return EXIT_FAILED
    except CallError as exc:
        print(f"corral: import refused: {exc.message}", file=sys.stderr)
        return EXIT_FAILED
    except StoreError as exc:
        hint = (" pass --session NEW_ID to import it under another id"
                if getattr(exc, "kind", "") == "session_exists" else "")
        print(f"corral: import refused: {exc};{hint}" if hint else
              f"corral: import refused: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if ns.json:
        sys.stdout.write(json.dumps({"ok": True, "session_id": session}) + "\n")
    else:
        print(f"imported as session {session}; continue with: corral run --session {session} "
              "PROMPT")
    os.sync()
    return EXIT_OK
