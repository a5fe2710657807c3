"""SIGUSR1's task dump names every task and where it waits."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import pytest

from broker.taskdump import dump_tasks, install_task_dump
from tests.helpers import eventually


async def parked_on_an_event(event: asyncio.Event) -> None:
    await event.wait()


async def test_sigusr1_logs_each_task_and_where_it_is_suspended(
        caplog: pytest.LogCaptureFixture) -> None:
    event = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(parked_on_an_event(event), name="request-r42")
        await asyncio.sleep(0)  # let it reach its await
        text = dump_tasks()
        assert "--- request-r42 (pending)" in text
        assert "parked_on_an_event" in text
        install_task_dump()
        try:
            with caplog.at_level(logging.WARNING, logger="broker.taskdump"):
                os.kill(os.getpid(), signal.SIGUSR1)

                async def logged() -> bool:
                    return any("request-r42" in r.getMessage() for r in caplog.records)
                await eventually(logged, timeout_s=5, what="the dump in the log")
        finally:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGUSR1)
            event.set()
