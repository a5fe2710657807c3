"""Checkpoints and the store: import a checkpoint as a new session, and keep the
checkpoint under export referenced from the session's state.

``loop_reference(doc)`` is what the engine stores in
``CheckpointState.export_loop_checkpoint`` (committed BEFORE any sink is called, cleared
when the run completes). It is small: the messages and events are referenced by
position (epoch, batch, event range) in the append-only store, never copied into the
state row. ``load_loop_checkpoint(store, session_id)`` rebuilds the exact document from
the store and checks its digest against the reference.

Import rules (``import_checkpoint``):
- the document must ``verify`` clean (else ``CheckpointInvalid`` with the problems);
- with ``expected_binding``, the checkpoint's capability binding must equal it exactly
  (else ``BindingMismatch``): a checkpoint never resumes under other tools or policy;
- the new session's epoch-0 context snapshot is the checkpoint's messages (reasons
  ["import"]); its state carries the usage; its config records where it came from;
- the id is ``new_session_id`` or the checkpoint's session id (``SessionExists`` if
  taken).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from typing import Any

from supervisor.export.canonical import canonical_bytes
from supervisor.export.checkpoint import event_json, find_run, seal, verify
from supervisor.export.errors import BindingMismatch, CheckpointInvalid
from supervisor.store import (
    CheckpointState,
    ContextRewrite,
    SessionId,
    SessionRecord,
    SessionStore,
    StepWrite,
)

IMPORT_REASON = "import"


def loop_reference(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The small reference to ``doc`` kept in ``CheckpointState.export_loop_checkpoint``."""
    descriptor = doc["descriptor"]
    logical = doc["content"]["logical_resume"]
    run = find_run(doc, logical["run_id"])
    if run is None:
        raise CheckpointInvalid([f"no run record with id {logical['run_id']!r}"])
    events = run["events"]
    return {
        "digest": descriptor["digest"],
        "session_id": descriptor["session_id"],
        "run_id": descriptor["run_id"],
        "turn": descriptor["turn"],
        "resume": {k: copy.deepcopy(v) for k, v in logical.items() if k != "messages"},
        "run": copy.deepcopy(run["snapshot"]),
        "events": {"first": events[0]["sequence"] if events else 0,
                   "last": events[-1]["sequence"] if events else 0},
    }


async def load_loop_checkpoint(store: SessionStore,
                               session_id: SessionId) -> dict[str, Any] | None:
    """Rebuild the checkpoint under export from the store; None when there is none.

    Raises ``CheckpointInvalid`` if what the store holds does not hash to the digest that
    was exported (the store and the sink would disagree).
    """
    loaded = await store.load(session_id)
    if loaded is None or loaded.state.export_loop_checkpoint is None:
        return None
    ref = loaded.state.export_loop_checkpoint
    position = ref["resume"]["position"]
    messages = await store.context_at(session_id, at_batch=position["at_batch"],
                                      epoch=position["epoch"])
    events: list[dict[str, Any]] = []
    first, last = ref["events"]["first"], ref["events"]["last"]
    after = first - 1
    while first and after < last:
        page = await store.events_page(session_id, after_sequence=after,
                                       limit=min(5000, last - after))
        if not page.items:
            break
        events.extend(event_json(e) for e in page.items)
        after = page.items[-1].sequence
    resume = dict(ref["resume"])
    resume["messages"] = messages or []
    content = {"logical_resume": resume,
               "snapshot": {"run_records": [{"snapshot": ref["run"], "events": events}]}}
    doc = seal(content)
    if doc["descriptor"]["digest"] != ref["digest"]:
        raise CheckpointInvalid(["the store's checkpoint under export does not match the "
                                 "exported digest"])
    return doc


async def import_checkpoint(
    store: SessionStore,
    doc: Mapping[str, Any],
    *,
    expected_binding: Mapping[str, Any] | None = None,
    new_session_id: SessionId | None = None,
    config: Mapping[str, Any] | None = None,
) -> SessionRecord:
    """Create a session from a verified checkpoint (see the module docstring)."""
    problems = verify(doc)
    if problems:
        raise CheckpointInvalid(problems)
    descriptor = doc["descriptor"]
    logical = doc["content"]["logical_resume"]
    binding = logical["capability_binding"]
    if expected_binding is not None and canonical_bytes(dict(expected_binding)) \
            != canonical_bytes(binding):
        raise BindingMismatch("the checkpoint's capability binding (tools and policy) "
                              "differs from the expected one; refusing to import")
    session_id = SessionId(new_session_id or logical["session_id"])
    origin = {"digest": descriptor["digest"], "session_id": descriptor["session_id"],
              "run_id": descriptor["run_id"], "turn": descriptor["turn"]}
    record = SessionRecord(
        session_id=session_id,
        created_at=time.time(),
        config={**dict(config or {}), "imported_checkpoint": origin,
                "capability_binding": copy.deepcopy(binding)},
    )
    state = CheckpointState(
        total_usage=dict(logical["usage"]),
        last_rewrite={"epoch": 0, "reasons": [IMPORT_REASON], "at_batch": 0},
        extra={"imported_checkpoint": origin},
    )
    first = StepWrite(
        session_id,
        rewrite=ContextRewrite(epoch=0, items=copy.deepcopy(logical["messages"]),
                               reasons=[IMPORT_REASON], at_batch=0),
        state=state,
    )
    await store.create_session(record, first)
    return record
