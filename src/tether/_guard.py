"""SendGuard: bounds the writes of one response to a client that stopped reading.

A client that stops reading without closing its connection blocks the server's
writes on flow control for ever. Wrapping each write in ``asyncio.timeout``
bounds that, but arms and cancels a timer for every write, on the hot path of
every stream. A guard instead keeps one timer per response, armed at most once
per ``limit`` seconds: when it fires during a write that began ``limit`` seconds
ago or more, the client counts as stalled and the writing task is cancelled out
of that write (as ``asyncio.timeout`` would do it); otherwise it re-arms for the
current write's deadline, or lets the next write arm it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Final

__all__ = ["SendGuard"]

_now = time.monotonic  # the clock of asyncio's default loops
_SLACK: Final = 1e-3


class SendGuard:
    """Awaits writes, ending any one that waits longer than ``limit`` seconds.

    :param limit: seconds one write may wait; ``None`` leaves writes unbounded.
    """

    __slots__ = ("_busy", "_limit", "_since", "_task", "_timer", "stalled")

    def __init__(self, limit: float | None) -> None:
        self._limit = limit
        self._busy = False
        self._since = 0.0
        self._task: asyncio.Task[object] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.stalled = False
        """Whether a write waited past the limit (the client stopped reading)."""

    def begin(self) -> None:
        """A write of the response starts now (the writing task is the current one).

        Costs two attribute sets and, at most once per ``limit`` seconds, a timer:
        adapters call it around every write, with no coroutine of its own.
        """
        limit = self._limit
        if limit is None:
            return
        self._since = _now()
        self._busy = True
        if self._timer is None:
            self._task = asyncio.current_task()
            self._timer = asyncio.get_running_loop().call_later(limit, self._tick)

    def end(self) -> None:
        """The write started by :meth:`begin` completed (or failed)."""
        self._busy = False

    def stalled_out(self) -> bool:
        """In a write interrupted by ``CancelledError``: whether the guard cancelled it
        (the client stalled) rather than someone else; if so, the cancellation is
        consumed here and the writer ends its response instead of raising."""
        self._busy = False
        task = self._task
        return self.stalled and task is not None and task.uncancel() == 0

    async def write(self, write: Awaitable[object]) -> bool:
        """Await ``write``; ``False`` if it waited past the limit and was abandoned.

        Must be awaited by the task that writes the response.
        """
        self.begin()
        try:
            await write
        except asyncio.CancelledError:
            if self.stalled_out():
                return False
            raise
        finally:
            self.end()
        return True

    def _tick(self) -> None:
        self._timer = None
        limit = self._limit
        if not self._busy or limit is None:
            return  # between writes: the next write arms the timer again
        left = self._since + limit - _now()
        if left > _SLACK:
            self._timer = asyncio.get_running_loop().call_later(left, self._tick)
        elif self._task is not None:
            self.stalled = True
            self._task.cancel()

    def close(self) -> None:
        """Stop the timer (the response ended)."""
        timer = self._timer
        if timer is not None:
            self._timer = None
            timer.cancel()
