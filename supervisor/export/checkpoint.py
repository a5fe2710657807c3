"""The portable checkpoint document: build it at a tool boundary, verify it anywhere.

Layout (``version`` 1)::

    {"descriptor": {"schema": "corral.checkpoint", "version": 1,
                    "digest": "sha256:<hex of canonical JSON of content>",
                    "size": <bytes of that canonical JSON>,
                    "session_id": ..., "turn": <tool rounds done in this run>, "run_id": ...},
     "content": {
       "logical_resume": {"session_id", "run_id", "turn",
                          "messages": [context items, including tool outputs],
                          "usage": {Usage}, "capability_binding": BINDING,
                          "tool_rounds": [{"round": 1, "call_ids": [...]}, ...],
                          "position": {"epoch", "at_batch"}},
       "snapshot": {"run_records": [
           {"snapshot": {"id": run_id, "session_id", "status": "running", "event_count",
                         "capability_binding": BINDING, "execution": {ExecutionRecord}},
            "events": [{"sequence", "type", "payload", "submission_id", "created_at"}]}]}}}

    BINDING = {"tools": [{"name", "schema_digest"}] (sorted by name),
               "policy_digest": "sha256:...",
               # only when the session has any (older checkpoints have neither):
               "mcp_servers": [{"name", "spec_digest"}] (sorted by name),
               "client_tools": [{"name", "schema_digest"}] (sorted by name)}

Invariants (what ``verify`` checks; it never raises on a malformed document):
- the digest and size match the canonical JSON of ``content``;
- descriptor, logical resume and run snapshot agree on session id, run id and turn;
- the capability binding is identical in the logical part and in the run snapshot;
- the run is non-terminal (a checkpoint is taken mid-run, at a tool boundary);
- the run's events have dense ascending sequences and ``event_count`` matches them;
- turn consistency: ``turn`` >= 1 equals the number of tool rounds, rounds are numbered
  1..turn, and every call of every round has its ``tool_call_end`` event and its
  ``function_call_output`` message.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from broker import plants  # chaos plant switches (broker/plants.py)
from supervisor.export.canonical import canonical_bytes, digest, digest_bytes, is_digest
from supervisor.store.records import EventRecord, ExecutionRecord

SCHEMA = "corral.checkpoint"
VERSION = 1
TERMINAL_STATUSES = frozenset({"completed", "aborted", "failed"})
TOOL_END_EVENT = "tool_call_end"


def capability_binding(tools: Iterable[Mapping[str, Any]],
                       policy: Mapping[str, Any], *,
                       mcp_servers: Mapping[str, Mapping[str, Any]] | None = None,
                       client_tools: Iterable[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """Bind a checkpoint to the tools (by schema digest) and policy it ran under,
    and to its MCP servers (by the digest of each ``[mcp.NAME]`` spec: their
    tools are listed at run time) and client tools (by schema digest). The two
    last fields are there only when non-empty, so a binding without them is
    the one older checkpoints carry."""
    binding: dict[str, Any] = {"tools": _entries(tools, "schema_digest"),
                               "policy_digest": digest(dict(policy))}
    if mcp_servers:
        binding["mcp_servers"] = sorted(
            ({"name": str(name), "spec_digest": digest(dict(spec))}
             for name, spec in mcp_servers.items()), key=lambda e: e["name"])
    clients = _entries(client_tools, "schema_digest")
    if clients:
        binding["client_tools"] = clients
    return binding


def _entries(tools: Iterable[Mapping[str, Any]], key: str) -> list[dict[str, Any]]:
    return sorted(({"name": str(t["name"]), key: digest(dict(t))} for t in tools),
                  key=lambda e: e["name"])


def event_json(event: EventRecord) -> dict[str, Any]:
    return {"sequence": event.sequence, "type": event.type, "payload": event.payload,
            "submission_id": event.submission_id, "created_at": event.created_at}


def build_checkpoint(
    *,
    session_id: str,
    run_id: str,
    turn: int,
    messages: Sequence[Mapping[str, Any]],
    usage: Mapping[str, int],
    binding: Mapping[str, Any],
    tool_rounds: Sequence[Sequence[str]],
    execution: ExecutionRecord,
    events: Sequence[EventRecord],
    epoch: int,
    at_batch: int,
) -> dict[str, Any]:
    """The checkpoint document of one run at a tool boundary (see the module docstring).

    ``tool_rounds[i]`` holds the call ids of round ``i + 1``; ``epoch``/``at_batch`` say
    where in the session's store the ``messages`` stand (context after batch ``at_batch``).
    """
    content = {
        "logical_resume": {
            "session_id": session_id,
            "run_id": run_id,
            "turn": turn,
            "messages": [dict(m) for m in messages],
            "usage": dict(usage),
            "capability_binding": dict(binding),
            "tool_rounds": [{"round": i + 1, "call_ids": list(ids)}
                            for i, ids in enumerate(tool_rounds)],
            "position": {"epoch": epoch, "at_batch": at_batch},
        },
        "snapshot": {
            "run_records": [{
                "snapshot": {
                    "id": run_id,
                    "session_id": session_id,
                    "status": execution.outcome,
                    "event_count": len(events),
                    "capability_binding": dict(binding),
                    "execution": asdict(execution),
                },
                "events": [event_json(e) for e in events],
            }],
        },
    }
    return seal(content)


def _digested(content: dict[str, Any]) -> dict[str, Any]:
    """What the digest covers: all of ``content``."""
    if plants.on("export_digest_partial"):  # chaos plant: run records left out
        return {**content, "snapshot": {**content.get("snapshot", {}), "run_records": []}}
    return content


def seal(content: dict[str, Any]) -> dict[str, Any]:
    """Wrap ``content`` with its descriptor (digest and size of its canonical JSON)."""
    data = canonical_bytes(_digested(content))
    logical = content["logical_resume"]
    return {
        "descriptor": {
            "schema": SCHEMA,
            "version": VERSION,
            "digest": digest_bytes(data),
            "size": len(data),
            "session_id": logical["session_id"],
            "turn": logical["turn"],
            "run_id": logical["run_id"],
        },
        "content": content,
    }


def find_run(doc: Mapping[str, Any], run_id: str) -> dict[str, Any] | None:
    """The run record whose snapshot id is ``run_id``."""
    try:
        for record in doc["content"]["snapshot"]["run_records"]:
            if record["snapshot"]["id"] == run_id:
                return dict(record)
    except (KeyError, TypeError):
        return None
    return None


def _binding_problems(binding: object, where: str) -> list[str]:
    if not isinstance(binding, dict):
        return [f"{where}: capability binding missing"]
    problems = []
    tools = binding.get("tools")
    if not isinstance(tools, list) or not all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and is_digest(t.get("schema_digest"))
        for t in tools
    ):
        problems.append(f"{where}: binding tools must be [{{name, schema_digest}}]")
    elif [t["name"] for t in tools] != sorted({t["name"] for t in tools}):
        problems.append(f"{where}: binding tools must be sorted by name and unique")
    if not is_digest(binding.get("policy_digest")):
        problems.append(f"{where}: binding policy_digest is not a sha256 digest")
    for field, key in (("mcp_servers", "spec_digest"), ("client_tools", "schema_digest")):
        if field not in binding:
            continue
        entries = binding[field]
        if not isinstance(entries, list) or not entries or not all(
            isinstance(e, dict) and isinstance(e.get("name"), str) and is_digest(e.get(key))
            for e in entries
        ):
            problems.append(f"{where}: binding {field} must be a non-empty [{{name, {key}}}]")
        elif [e["name"] for e in entries] != sorted({e["name"] for e in entries}):
            problems.append(f"{where}: binding {field} must be sorted by name and unique")
    return problems


def verify(doc: object) -> list[str]:
    """Every problem found in ``doc``; an empty list means it is a valid checkpoint."""
    if not isinstance(doc, dict):
        return ["document is not a JSON object"]
    descriptor, content = doc.get("descriptor"), doc.get("content")
    if not isinstance(descriptor, dict) or not isinstance(content, dict):
        return ["document needs a descriptor object and a content object"]
    problems: list[str] = []
    if descriptor.get("schema") != SCHEMA:
        problems.append(f"descriptor.schema is {descriptor.get('schema')!r}, not {SCHEMA!r}")
    if descriptor.get("version") != VERSION:
        problems.append(f"unsupported version {descriptor.get('version')!r} (this reader: "
                        f"{VERSION})")
    try:
        data = canonical_bytes(_digested(content))
    except (TypeError, ValueError) as exc:
        return [*problems, f"content is not canonical JSON: {exc}"]
    if descriptor.get("digest") != digest_bytes(data):
        problems.append("digest does not match the content")
    if descriptor.get("size") != len(data):
        problems.append(f"size {descriptor.get('size')!r} does not match the content "
                        f"({len(data)} bytes)")
    logical = content.get("logical_resume")
    if not isinstance(logical, dict):
        return [*problems, "content.logical_resume missing"]
    for field in ("session_id", "run_id", "turn"):
        if descriptor.get(field) != logical.get(field):
            problems.append(f"descriptor.{field} differs from logical_resume.{field}")
    run_id = logical.get("run_id")
    run = find_run(doc, run_id) if isinstance(run_id, str) else None
    if run is None:
        return [*problems, f"no run record with id {run_id!r} in the snapshot"]
    snap, events = run.get("snapshot"), run.get("events")
    if not isinstance(snap, dict) or not isinstance(events, list):
        return [*problems, "run record needs a snapshot object and an events list"]
    problems += _binding_problems(logical.get("capability_binding"), "logical_resume")
    if logical.get("capability_binding") != snap.get("capability_binding"):
        problems.append("capability binding differs between logical_resume and the run")
    if snap.get("session_id") != logical.get("session_id"):
        problems.append("run snapshot belongs to another session")
    if snap.get("status") in TERMINAL_STATUSES or snap.get("status") is None:
        problems.append(f"run status {snap.get('status')!r} is terminal or missing")
    execution = snap.get("execution")
    if isinstance(execution, dict) and execution.get("turn_id") != run_id:
        problems.append("execution record is not the run's")
    problems += _event_problems(events, snap.get("event_count"))
    problems += _turn_problems(logical, events)
    return problems


def _event_problems(events: list[Any], event_count: object) -> list[str]:
    if not all(isinstance(e, dict) and isinstance(e.get("sequence"), int) for e in events):
        return ["every event needs an integer sequence"]
    problems = []
    sequences = [e["sequence"] for e in events]
    if sequences and sequences != list(range(sequences[0], sequences[0] + len(sequences))):
        problems.append("event sequences are not dense and ascending")
    if sequences and sequences[0] < 1:
        problems.append("event sequences start below 1")
    if event_count != len(events):
        problems.append(f"event_count {event_count!r} but {len(events)} events")
    return problems


def _turn_problems(logical: dict[str, Any], events: list[Any]) -> list[str]:
    turn, rounds = logical.get("turn"), logical.get("tool_rounds")
    messages = logical.get("messages")
    if not isinstance(turn, int) or turn < 1:
        return [f"turn {turn!r} must be an integer >= 1 (a checkpoint follows a tool round)"]
    if not isinstance(rounds, list) or not isinstance(messages, list):
        return ["logical_resume needs tool_rounds and messages lists"]
    if len(rounds) != turn:
        return [f"turn is {turn} but {len(rounds)} tool rounds are recorded"]
    ended = {e.get("payload", {}).get("call_id") for e in events
             if isinstance(e, dict) and e.get("type") == TOOL_END_EVENT
             and isinstance(e.get("payload"), dict)}
    outputs = {m.get("call_id") for m in messages
               if isinstance(m, dict) and m.get("type") == "function_call_output"}
    # A compaction inside the turn folds its earlier rounds into the compaction
    # item: a call gone from the context entirely is compacted, not missing
    # (a call still in the context must still have its output).
    compacted = any(isinstance(m, dict) and m.get("type") == "compaction" for m in messages)
    calls = {m.get("call_id") for m in messages
             if isinstance(m, dict) and m.get("type") == "function_call"}
    problems = []
    for i, r in enumerate(rounds):
        if not isinstance(r, dict) or r.get("round") != i + 1 or not isinstance(
                r.get("call_ids"), list) or not r["call_ids"]:
            problems.append(f"tool round {i + 1} is malformed")
            continue
        for call_id in r["call_ids"]:
            if call_id not in ended:
                problems.append(f"round {i + 1}: call {call_id!r} has no {TOOL_END_EVENT} event")
            if call_id not in outputs and not (compacted and call_id not in calls):
                problems.append(f"round {i + 1}: call {call_id!r} has no function_call_output")
    return problems
