"""Stopping the tasks one owns: cancel, then wait for them to end.

Every background task (a receive watcher, a socket reader, an engine loop) has an
owner that cancels and awaits it. Awaiting a task cancelled just now raises its
``CancelledError`` in the owner; that one is consumed, while a cancellation of the
owner itself (``current_task().cancelling()``) goes on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

__all__ = ["stop_tasks"]


async def stop_tasks(tasks: Iterable[asyncio.Task[object] | asyncio.Future[object]]) -> None:
    """Cancel ``tasks`` and wait until each has ended. Their own cancellation is not
    raised; a cancellation of the caller is; so is any other exception of theirs."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    for task in tasks:
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
