"""SIGUSR1 dumps every asyncio task's stack to the process log.

Thread stacks are what ``py-spy dump`` shows; a process whose event loop is
idle while requests hang is stuck in *tasks*, which no external tool sees.
``install_task_dump()`` makes ``kill -USR1 PID`` write one WARNING record per
task (name, state, where it is suspended) to the process's log, for the
worker and supervisor processes alike (documented in docs/operations.md).

Bounds: at most ``MAX_TASKS`` tasks and ``MAX_FRAMES`` frames per task are
written, so a process with 100,000 tasks does not flood its bounded log.
"""

from __future__ import annotations

import asyncio
import io
import logging
import signal

log = logging.getLogger(__name__)

MAX_TASKS = 2000
MAX_FRAMES = 12


def dump_tasks() -> str:
    """The stacks of the running loop's tasks, as text."""
    tasks = sorted(asyncio.all_tasks(), key=lambda t: t.get_name())
    buf = io.StringIO()
    buf.write(f"{len(tasks)} asyncio tasks\n")
    for task in tasks[:MAX_TASKS]:
        state = "cancelling" if task.cancelling() else "pending"
        buf.write(f"--- {task.get_name()} ({state}) {task.get_coro()!r:.200}\n")
        task.print_stack(limit=MAX_FRAMES, file=buf)
    if len(tasks) > MAX_TASKS:
        buf.write(f"... {len(tasks) - MAX_TASKS} more tasks not shown\n")
    return buf.getvalue()


def install_task_dump(loop: asyncio.AbstractEventLoop | None = None) -> None:
    """On SIGUSR1, log every task's stack at WARNING (from the loop, never a signal frame)."""
    loop = loop or asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, lambda: log.warning("%s", dump_tasks()))
