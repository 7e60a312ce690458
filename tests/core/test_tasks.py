"""stop_tasks: an owner stops its tasks; their cancellation ends there, its own goes on."""

from __future__ import annotations

import asyncio

import pytest

from tether.http import stop_tasks


async def test_stopping_tasks_ends_each_and_raises_nothing_of_theirs() -> None:
    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    tasks = [asyncio.create_task(forever()) for _ in range(3)]
    async with asyncio.timeout(10):
        await started.wait()
        await stop_tasks(tasks)
    assert all(task.cancelled() for task in tasks)


async def test_a_cancellation_of_the_owner_while_it_stops_its_tasks_goes_on() -> None:
    stopping = asyncio.Event()

    async def stubborn() -> None:  # takes a while to end once cancelled
        try:
            await asyncio.Event().wait()
        finally:
            stopping.set()
            await asyncio.Event().wait()

    async def owner(task: asyncio.Task[None]) -> None:
        await stop_tasks((task,))

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)  # one loop turn: the task starts waiting
    stopper = asyncio.create_task(owner(task))
    async with asyncio.timeout(10):
        await stopping.wait()
        stopper.cancel()  # the owner is cancelled while it waits for its task
        with pytest.raises(asyncio.CancelledError):
            await stopper
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
