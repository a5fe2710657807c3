"""Command hooks: the hook events sent to external programs, run in the sandbox.

A session's ``hooks`` config lists ``{"event", "command", "timeout_s"}``. Each
entry becomes one ``CommandHook`` middleware (in config order, after the
Python middlewares). The hook input is JSON on the program's stdin, its
``HookResult`` is the JSON object on the last line of its stdout (empty
stdout: no opinion). The program never runs in the supervisor: it is sent as
a ``shell`` tool call to the tool service, with the input piped in
(base64 inside the command line, decoded by the sandboxed shell).

Invariants:
- A timeout, a crash (non-zero exit, lost worker) or unreadable output counts
  as a **deny** for events that can deny (user_prompt_submit → reject,
  pre_tool / permission_request → deny): fail closed. For other events it is a
  ``HookFailed`` (an infrastructure failure: the turn fails cleanly).
- The input is bounded (``MAX_INPUT_BYTES``): big fields (context, request)
  are cut down to their tail, and that is said in the input.
"""

from __future__ import annotations

import base64
import json
import shlex
from typing import Any, Final, Protocol

from sandbox_worker.api import ToolCallRequest, ToolPolicy
from supervisor.engine import events as ev
from supervisor.engine.calls import Broker, call_tool
from supervisor.engine.config import EngineConfig, SessionSpec
from supervisor.engine.errors import CallFailed, HookFailed
from supervisor.engine.hooks import DENYING_EVENTS, HookEvent, HookInput, HookResult, Middleware


class CommandHost(Protocol):
    """What command hooks need of the manager (``SessionManager``): the broker
    their ``shell`` calls go through, and the process-wide config."""

    @property
    def broker(self) -> Broker: ...
    @property
    def config(self) -> EngineConfig: ...

MAX_INPUT_BYTES: Final = 64 * 1024


def _bounded_input(inp: HookInput) -> bytes:
    data = inp.to_json()
    raw = json.dumps(data, default=str).encode()
    if len(raw) <= MAX_INPUT_BYTES:
        return raw
    for key in ("context", "request"):
        if key in data:
            value = data[key]
            if key == "request" and isinstance(value, dict):
                value = {k: v for k, v in value.items() if k != "items"}
                data[key] = value
            elif isinstance(value, list):
                data[key] = value[-8:]
            data["truncated"] = True
    raw = json.dumps(data, default=str).encode()
    return raw[:MAX_INPUT_BYTES] if len(raw) > MAX_INPUT_BYTES else raw


def _last_json_line(output: str) -> Any:
    for line in reversed(output.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    return None


class CommandHook(Middleware):
    def __init__(self, manager: CommandHost, spec: SessionSpec, hook: dict[str, Any],
                 index: int) -> None:
        self.manager = manager
        self.spec = spec
        self.event = HookEvent(hook["event"])
        self.command = str(hook["command"])
        self.timeout_s = float(hook.get("timeout_s", manager.config.command_hook_timeout_s))
        self.name = f"command_hook[{index}]"

    async def _invoke(self, inp: HookInput) -> HookResult | None:
        if inp.event is not self.event:
            return None
        try:
            return await self._run(inp)
        except (CallFailed, ValueError, HookFailed) as exc:
            why = f"{self.name} ({self.event}) failed: {exc}"
            if self.event is HookEvent.USER_PROMPT_SUBMIT:
                return HookResult(reject=why)
            if self.event in DENYING_EVENTS:
                return HookResult(deny=why)
            raise HookFailed(why) from exc

    async def _run(self, inp: HookInput) -> HookResult | None:
        payload = base64.b64encode(_bounded_input(inp)).decode()
        command = f"printf '%s' {shlex.quote(payload)} | base64 -d | ( {self.command} )"
        policy: ToolPolicy = dict(self.spec.tool_policy)  # type: ignore[assignment]
        policy["limits"] = {**policy.get("limits", {}), "wall_s": self.timeout_s}
        request = ToolCallRequest(call_id=ev.new_id("hook"), tool="shell",
                                  arguments={"command": command, "timeout_s": self.timeout_s},
                                  session_id=inp.session_id, workspace=self.spec.workspace,
                                  policy=policy)
        result = await call_tool(self.manager.broker, request, budget_s=self.timeout_s + 5.0,
                                 cancel_grace_s=self.manager.config.cancel_grace_s)
        if result.get("outcome") == "timeout":
            raise ValueError(f"timed out after {self.timeout_s}s")
        if result.get("is_error") or result.get("exit_code") not in (0, None):
            raise ValueError(f"exited with {result.get('exit_code')}: "
                             f"{str(result.get('output', ''))[-500:]}")
        parsed = _last_json_line(str(result.get("output", "")))
        if parsed is None:
            return None
        return HookResult.from_json(parsed)

    async def session_start(self, inp: HookInput) -> HookResult | None:
        return await self._invoke(inp)

    async def user_prompt_submit(self, inp: HookInput) -> HookResult | None:
        return await self._invoke(inp)

    async def pre_model(self, inp: HookInput) -> HookResult | None:
        return await self._invoke(inp)

    async def model_request(self, inp: HookInput) -> HookResult | None:
        return await self._invoke(inp)

    async def pre_tool(self, inp: HookInput) -> HookResult | None:
        return await self._invoke(inp)

    async def permission_request(self, inp: HookInput) -> HookResult | None:
        return await self._invoke(inp)

    async def post_tool(self, inp: HookInput) -> HookResult | None:
        return await self._invoke(inp)

    async def pre_compact(self, inp: HookInput) -> HookResult | None:
        return await self._invoke(inp)

    async def post_compact(self, inp: HookInput) -> HookResult | None:
        return await self._invoke(inp)

    async def stop(self, inp: HookInput) -> HookResult | None:
        return await self._invoke(inp)

    async def turn_end(self, inp: HookInput) -> HookResult | None:
        return await self._invoke(inp)

    async def session_end(self, inp: HookInput) -> HookResult | None:
        return await self._invoke(inp)


def command_hooks(manager: CommandHost, spec: SessionSpec) -> list[Middleware]:
    return [CommandHook(manager, spec, hook, i) for i, hook in enumerate(spec.hooks)]
