"""A session's image: resolved and checked when the session is created.

``corral run --image REF``, ``SessionOptions(image=REF)`` and the
session-create request's ``image`` key all come here (``Facade``): ``REF``
(``NAME[:TAG]``, ``sha256:HEX`` or ``NAME@sha256:HEX``) is resolved in the
farm's store to its manifest digest, which goes into the session's tool
policy (``ToolPolicy.image``), so every tool call of the session carries it
and the session config persists it.

Invariants:
- Bad input is refused here, at session creation, never at the first tool
  call: a malformed reference or one the store does not hold
  (``image_not_found``); a farm whose registered tool workers all say they
  cannot run calls over images (``images_unsupported``, with their reasons).
- With no tool worker registered yet the image is accepted (workers may still
  be starting; a call then waits in the broker's queue like any other).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from sandbox_worker.api import SERVICE_TOOL
from supervisor.images.errors import ImageError
from supervisor.images.store import ImageStore
from supervisor.server import CallError
from supervisor.wire import ErrorKind

log = logging.getLogger(__name__)


def image_workers(status: dict[str, Any]) -> tuple[int, int, list[str]]:
    """(tool workers, of which can run image calls, their reasons why not)
    from the broker's STATUS map (``workers``: per service, the entries of the
    workers serving it, each with its READY info)."""
    total = able = 0
    why: list[str] = []
    services = status.get("workers")
    tool_entry = services.get(SERVICE_TOOL) if isinstance(services, dict) else None
    workers = tool_entry.get("workers") if isinstance(tool_entry, dict) else None
    for worker in workers if isinstance(workers, list) else []:
        if not isinstance(worker, dict):
            continue
        total += 1
        tool = (worker.get("info") or {}).get(SERVICE_TOOL) or {}
        images = tool.get("images") if isinstance(tool, dict) else None
        if isinstance(images, dict) and images.get("overlay") is True:
            able += 1
        else:
            reason = images.get("reason") if isinstance(images, dict) else None
            why.append(str(reason or "the worker does not support images (an older version)"))
    return total, able, why


async def resolve_image(ref: Any, home: Path, broker: Any) -> str:
    """The manifest digest of ``ref`` in ``home``'s store; ``CallError`` when
    it is not there or no registered worker can run calls over images."""
    if not isinstance(ref, str) or not ref or len(ref) > 512:
        raise CallError(ErrorKind.BAD_REQUEST,
                        "image must be NAME[:TAG], sha256:HEX or NAME@sha256:HEX")
    try:
        info = await asyncio.to_thread(ImageStore(home).resolve, ref)
    except ImageError as exc:
        raise CallError(ErrorKind.IMAGE_NOT_FOUND, str(exc)) from None
    try:
        status = await broker.status(timeout_s=2.0)
    except Exception as exc:  # the broker is down: the session may still be made
        log.warning("could not ask the broker which workers run images: %s", exc)
        return info.digest
    total, able, why = image_workers(status)
    if total and not able:
        reasons = "; ".join(sorted(set(why)))[:600]
        raise CallError(ErrorKind.IMAGES_UNSUPPORTED,
                        f"no worker of this farm can run tools in an image ({reasons}); "
                        "workers need bubblewrap at tier T2, overlayfs and --images DIR")
    return info.digest
