"""The wake-up both mailboxes share (``_state``): one future a waiting consumer
parks on, made only when it has to wait (an ``asyncio.Event`` per request costs
twice as much at ten thousand requests), and :data:`NOTHING`, "no output yet"
where ``None`` is a valid output.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

__all__ = ["NOTHING", "Mailbox"]


class _Nothing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NOTHING"


NOTHING: Final[Any] = _Nothing()
"""Marks "no output yet" where ``None`` is a valid output."""


class Mailbox:
    """What both mailboxes share: the one future a waiting consumer parks on, made
    only when it has to wait, and the one way to wake it."""

    __slots__ = ("waiter",)

    def __init__(self) -> None:
        self.waiter: asyncio.Future[None] | None = None

    def park(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """A new future for the consumer to wait on, which :meth:`wake` resolves."""
        waiter: asyncio.Future[None] = _Future(loop=loop)
        self.waiter = waiter
        return waiter

    def unpark(self, waiter: asyncio.Future[None]) -> None:
        """The consumer waiting on ``waiter`` stopped waiting (cancelled)."""
        if self.waiter is waiter:
            self.waiter = None

    def wake(self) -> None:
        """Wake the consumer, if it waits (it may have been cancelled meanwhile)."""
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)


_Future = asyncio.Future
"""Waiters are made directly (``loop.create_future()`` adds a Python call per wait)."""
