"""The wake-up both mailboxes share (``_state``): one future a waiting consumer
parks on, made only when it has to wait (an ``asyncio.Event`` per request costs
twice as much at ten thousand requests), and :data:`NOTHING`, "no output yet"
where ``None`` is a valid output.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

__all__ = ["NOTHING", "Handoff", "Mailbox"]


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

    def hand_to(self, handoff: Handoff) -> None:
        """The consumer waits on ``handoff`` for its next output itself (see :class:`Handoff`)."""
        self.waiter = handoff

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
                if isinstance(waiter, Handoff):
                    waiter.settle()  # woken without an output: its reader says what it gets
                else:
                    waiter.set_result(None)


_Future = asyncio.Future
"""Waiters are made directly (``loop.create_future()`` adds a Python call per wait)."""


class Handoff(_Future):  # type: ignore[type-arg]
    """A waiter that the producer's ``put`` resolves with the output itself: the
    reader awaiting it resumes with its next output, and no code of tether's runs
    between the producer's call and the reader's code (no coroutine per output).

    Woken without an output (the request ended, failed or was aborted), it is its
    reader's to resolve with what the reader gets then: :meth:`settle`.
    """

    __slots__ = ()

    def settle(self) -> None:
        """Resolve with what the reader gets now that its request changed."""
        raise NotImplementedError
