"""An idle deadline served by one timer: a consumer that waits with a timeout (the
keep-alive interval) many times a second must not build, heap-push and cancel a
``TimerHandle`` for every wait.

The timer is armed for the first deadline and re-armed only when it fires before the
current one (a later wait moved the deadline on); a timer armed for a later deadline
than a new, shorter wait's is replaced. A wait that ends early leaves the timer armed
for the next one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final

__all__ = ["CLOCK_SLACK", "IdleDeadline"]

CLOCK_SLACK: Final = 1e-3
"""A timer that fires this close to its deadline counts as on time."""


class IdleDeadline:
    """The deadline of the current wait, and the one timer that serves it.

    :param expired: called once the deadline has passed, from the timer (it ends the
        wait); not called for a wait that ended first, or after :meth:`clear`.
    """

    __slots__ = ("_expired", "_timer", "_when", "deadline")

    def __init__(self, expired: Callable[[], None]) -> None:
        self._expired = expired
        self._timer: asyncio.TimerHandle | None = None
        self._when = 0.0
        self.deadline: float | None = None
        """When the current wait ends, in the loop's time; ``None`` for no limit."""

    @property
    def armed(self) -> bool:
        """Whether a timer is armed (it keeps nothing alive but this deadline)."""
        return self._timer is not None

    def set(self, loop: asyncio.AbstractEventLoop, timeout: float | None) -> None:
        """A wait starts now: it may last ``timeout`` seconds (``None``: no limit)."""
        if timeout is None:
            self.deadline = None
            return
        self.deadline = deadline = loop.time() + timeout
        timer = self._timer
        if timer is None or self._when > deadline + CLOCK_SLACK:
            if timer is not None:
                timer.cancel()
            self._timer = loop.call_at(deadline, self._fired, loop)
            self._when = deadline  # (the timer's own when(), without a call per wait)

    def clear(self) -> None:
        """No wait any more: stop the timer."""
        self.deadline = None
        timer = self._timer
        if timer is not None:
            self._timer = None
            timer.cancel()

    def _fired(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        deadline = self.deadline
        if deadline is None:
            return
        if loop.time() + CLOCK_SLACK >= deadline:
            self._expired()
        else:
            self._timer = loop.call_at(deadline, self._fired, loop)
            self._when = deadline
