"""Two tasks reading one stream: neither is left hanging.

A mailbox with one waiter slot would let a second reader that parks overwrite the
first one's future, and the first would never wake when the request finishes
(anyio raises ``BusyResourceError`` for a second concurrent receiver instead). It
takes only a handler that awaits ``result()`` while another task (a progress
watcher, a log tap) iterates the same stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import pytest

import tether


async def test_a_second_concurrent_reader_never_leaves_the_first_hanging() -> None:
    registry = tether.Registry()
    stream = registry.open()
    parked = [asyncio.Event(), asyncio.Event()]

    async def read(index: int, wait: Awaitable[object]) -> object:
        parked[index].set()  # the task goes on, in this same step, to park in the wait
        return await wait

    first = asyncio.create_task(read(0, stream.result()))
    second = asyncio.create_task(read(1, anext(stream)))
    async with asyncio.timeout(10):
        for event in parked:
            await event.wait()
    registry.deliver(stream.rid, "only", finished=True)
    try:
        # each reader ends one way or another: an output, the end, or a clear error
        done, _ = await asyncio.wait([first, second], timeout=2)
        if len(done) < 2:
            pytest.fail("a reader still waits 2 s after its request finished", pytrace=False)
    finally:
        for task in (first, second):
            task.cancel()
        await asyncio.wait([first, second])
        await stream.aclose()
