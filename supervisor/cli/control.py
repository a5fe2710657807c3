"""``corral approve`` and ``corral interrupt``: answer or stop a session's turn
in the running farm.

Both check the session first (``describe``), so a stale or mistyped approval
id, or a session with no running turn, is refused with exit 1 and a hint,
rather than submitted.
"""

from __future__ import annotations

import sys
from argparse import Namespace
from typing import Any

from supervisor.cli.common import EXIT_FAILED, EXIT_OK, Subparsers, add_home, add_json
from supervisor.cli.output import print_json, say_error
from supervisor.cli.reach import with_farm


def add_parsers(sub: Subparsers) -> None:
    p = sub.add_parser("approve", help="answer a pending approval request",
                       description="Answer the approval request ID that session SESSION "
                       "waits on. An id that is not pending (stale, mistyped, already "
                       "answered) is refused with exit 1.")
    add_home(p)
    p.add_argument("session", help="the session id (see 'corral sessions')")
    p.add_argument("id", help="the approval request id (from exec_approval_request)")
    p.add_argument("--decision", required=True,
                   choices=["approved", "approved_for_session", "denied", "abort"],
                   help="approved: run the calls once; approved_for_session: also these "
                   "exact calls later; denied: answer them with an error; abort: end the turn")
    add_json(p)
    p.set_defaults(handler=cmd_approve)

    p = sub.add_parser("interrupt", help="interrupt a session's active turn",
                       description="Interrupt the session's running turn: its tools are "
                       "cancelled and it ends as 'interrupted'; the session stays usable.")
    add_home(p)
    p.add_argument("session", help="the session id (see 'corral sessions')")
    add_json(p)
    p.set_defaults(handler=cmd_interrupt)


def _submit(ns: Namespace, op: dict[str, Any]) -> int:
    code, result = with_farm(ns, "submit", session_id=ns.session, op=op)
    if code == EXIT_OK:
        if ns.json:
            print_json({"ok": True, "submission_id": result})
        else:
            print(f"submitted ({result})")
    return code


def cmd_approve(ns: Namespace) -> int:
    code, described = with_farm(ns, "describe", session_id=ns.session)
    if code != EXIT_OK:
        return code
    pending = (described or {}).get("pending_approval") or {}
    if pending.get("id") != ns.id:
        now = (f"it waits on {pending.get('id')}" if pending.get("id")
               else "it waits on no approval")
        return say_error(ns, "unknown_approval", f"approval {ns.id!r} is not pending in "
                         f"session {ns.session} ({now}); see it with: corral show "
                         f"{ns.session}", EXIT_FAILED)
    return _submit(ns, {"type": "exec_approval", "id": ns.id, "decision": ns.decision})


def cmd_interrupt(ns: Namespace) -> int:
    code, described = with_farm(ns, "describe", session_id=ns.session)
    if code != EXIT_OK:
        return code
    turn = (described or {}).get("active_turn") or {}
    if not turn.get("turn_id"):
        msg = f"session {ns.session} has no active turn to interrupt"
        print(f"corral: {msg}", file=sys.stderr) if not ns.json else print_json(
            {"ok": False, "error": {"kind": "bad_op", "message": msg}})
        return EXIT_FAILED
    return _submit(ns, {"type": "interrupt", "turn_id": turn["turn_id"]})
