"""Approval policy: which tool calls run, which are denied, which need a human.

A policy is a default (``ask`` | ``allow`` | ``deny``), ordered rule lists and
a switch for read-only tools. A rule is ``tool(pattern)`` (``shell(git status*)``,
``read_file(*)``) or a bare tool name (any arguments); the tool part is an
``fnmatch`` glob too (``mcp__git__*``: every tool of the MCP server ``git``).
The pattern is an ``fnmatch`` glob over the call's *subject*: the command
line of ``shell``, the ``path`` of the file tools (other tools: their arguments
as JSON). Rules are checked deny → allow → ask; the first list with a match
decides; otherwise the read-only switch, then the default.

Config shape (``SessionSpec.approval``)::

    {"default": "ask", "deny": [...], "allow": [...], "ask": [...],
     "read_only": "allow"}

Invariants:
- A deny rule can never be weakened by an allow rule, ``approved_for_session``
  or a ``permission_request`` hook allow (the engine checks deny first).
- ``approved_for_session`` remembers the *exact* call (``call_key``), never a
  pattern: approving ``shell(rm -rf build)`` does not approve ``shell(rm -rf /)``.
- ``parse_policy`` raises ``ValueError`` on any malformed config.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from sandbox_worker.api import READ_ONLY_TOOLS

_RULE: Final = re.compile(r"^([A-Za-z0-9_.\-*?]+)(?:\((.*)\))?$", re.DOTALL)
MAX_RULES: Final = 256


class Decision(StrEnum):
    ALLOW = "allow"
    DENY = "deny"
    ASK = "ask"


@dataclass(frozen=True, slots=True)
class Rule:
    tool: str
    pattern: str  # "*" when the rule named the tool only

    def matches(self, tool: str, subject: str) -> bool:
        return fnmatch.fnmatchcase(tool, self.tool) and fnmatch.fnmatchcase(subject, self.pattern)

    def __str__(self) -> str:
        return f"{self.tool}({self.pattern})"


def parse_rule(text: str) -> Rule:
    if not isinstance(text, str) or len(text) > 4096:
        raise ValueError(f"a rule must be a string like 'shell(git status*)', got {text!r}")
    m = _RULE.match(text.strip())
    if m is None:
        raise ValueError(f"a rule must look like 'tool(pattern)', got {text!r}")
    return Rule(m.group(1), m.group(2) if m.group(2) is not None else "*")


@dataclass(frozen=True, slots=True)
class ApprovalPolicy:
    default: Decision = Decision.ASK
    deny: tuple[Rule, ...] = ()
    allow: tuple[Rule, ...] = ()
    ask: tuple[Rule, ...] = ()
    read_only: Decision | None = Decision.ALLOW  # None: read-only tools follow the default

    def decide(self, tool: str, arguments: Mapping[str, Any],
               approved_for_session: frozenset[str] = frozenset()) -> tuple[Decision, str]:
        """Decide one call; return (decision, reason) for records and prompts."""
        subject = call_subject(tool, arguments)
        for rule in self.deny:
            if rule.matches(tool, subject):
                return Decision.DENY, f"denied by rule {rule}"
        if call_key(tool, arguments) in approved_for_session:
            return Decision.ALLOW, "approved for this session"
        for rule in self.allow:
            if rule.matches(tool, subject):
                return Decision.ALLOW, f"allowed by rule {rule}"
        for rule in self.ask:
            if rule.matches(tool, subject):
                return Decision.ASK, f"rule {rule} asks for approval"
        if self.read_only is not None and tool in READ_ONLY_TOOLS:
            return self.read_only, f"read-only tool: {self.read_only}"
        return self.default, f"policy default: {self.default}"


def parse_policy(raw: Any) -> ApprovalPolicy:
    """Build a policy from config: a bare string (``"ask"``) or the mapping above."""
    if raw is None:
        return ApprovalPolicy()
    if isinstance(raw, str):
        return ApprovalPolicy(default=Decision(raw))
    if not isinstance(raw, Mapping):
        raise ValueError("approval policy must be 'ask' | 'allow' | 'deny' or a mapping")
    extra = set(raw) - {"default", "deny", "allow", "ask", "read_only"}
    if extra:
        raise ValueError(f"approval policy has unknown keys {sorted(extra)}")

    def rules(key: str) -> tuple[Rule, ...]:
        value = raw.get(key, [])
        if not isinstance(value, list) or len(value) > MAX_RULES:
            raise ValueError(f"approval policy {key!r} must be a list of at most {MAX_RULES}")
        return tuple(parse_rule(v) for v in value)

    read_only = raw.get("read_only", "allow")
    return ApprovalPolicy(
        default=Decision(raw.get("default", "ask")),
        deny=rules("deny"), allow=rules("allow"), ask=rules("ask"),
        read_only=None if read_only is None else Decision(read_only),
    )


def call_subject(tool: str, arguments: Mapping[str, Any]) -> str:
    """The string a rule pattern is matched against."""
    if tool == "shell":
        command = arguments.get("command", "")
        if isinstance(command, list):
            return " ".join(str(c) for c in command)
        return str(command)
    path = arguments.get("path")
    if isinstance(path, str):
        return path
    return json.dumps(dict(arguments), sort_keys=True, default=str)


def call_key(tool: str, arguments: Mapping[str, Any]) -> str:
    """The exact identity of a call, remembered by ``approved_for_session``.
    A long one is kept as its digest: the keys live in the state row, whose
    size is bounded (docs/storage.md, "Bounds and encoding")."""
    key = f"{tool}({json.dumps(dict(arguments), sort_keys=True, default=str)})"
    if len(key) <= _MAX_KEY_CHARS:
        return key
    return f"{tool[:256]}#sha256:{hashlib.sha256(key.encode('utf-8', 'replace')).hexdigest()}"


_MAX_KEY_CHARS = 1024
