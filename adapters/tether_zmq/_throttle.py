"""What a peer can make this end write to its log: a bounded number of lines, and
never a line of the peer's own making.

Every line a peer can cause (a refusal, a session it ends, a message this end could
not handle) goes through a :class:`Throttle` of its kind: a token bucket that lets
a burst of :data:`BURST` lines out at once, then one line per :data:`PERIOD` seconds,
and whose next line says how many like it went unsaid. However the peer cycles its
sessions, each kind of line costs at most ``BURST + t / PERIOD`` lines over ``t``
seconds; the counters (``stats()``) still count every event. Text the peer chose
goes into a line only through :func:`quoted`: escaped and cut.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final

from ._protocol import clip

__all__ = ["BURST", "PERIOD", "Throttle", "quoted"]

BURST: Final = 10
"""Lines of one kind let out at once, before the throttle holds them back."""
PERIOD: Final = 6.0
"""Seconds per line of one kind once its burst is spent (10 a minute)."""


def _clock() -> float:
    return time.monotonic()


class Throttle:
    """A token bucket for one kind of log line: O(1) per call, no timer.

    :param burst: lines let out at once (and the most the bucket holds).
    :param period: seconds to earn one more line.
    :param clock: a monotonic clock, in seconds (tests pass their own).
    """

    __slots__ = ("_at", "_burst", "_clock", "_period", "_tokens", "_unsaid")

    def __init__(
        self,
        *,
        burst: int = BURST,
        period: float = PERIOD,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._burst = float(burst)
        self._period = period
        self._clock = clock if clock is not None else _clock
        self._tokens = float(burst)
        self._at = self._clock()
        self._unsaid = 0

    def allow(self, *, count: bool = True) -> int | None:
        """Whether a line may go out now: the count of lines held back since the last
        one let out, or ``None`` (then this one is counted as held back, unless
        ``count`` is false: a line already counted, held back again)."""
        now = self._clock()
        tokens = min(self._burst, self._tokens + (now - self._at) / self._period)
        self._at = now
        if tokens < 1.0:
            self._tokens = tokens
            if count:
                self._unsaid += 1
            return None
        self._tokens = tokens - 1.0
        unsaid, self._unsaid = self._unsaid, 0
        return unsaid

    def log(
        self,
        logger: logging.Logger,
        level: int,
        msg: str,
        *args: object,
        exc_info: BaseException | None = None,
        count: bool = True,
    ) -> bool:
        """``logger.log(level, msg, *args)`` if the bucket allows it, saying how many
        lines like it went unsaid since the last; nothing at all if ``level`` is off.
        Whether the line went out (``count``: as for :meth:`allow`)."""
        if not logger.isEnabledFor(level):
            return False
        unsaid = self.allow(count=count)
        if unsaid is None:
            return False
        if unsaid:
            msg += " (and %d more like it unsaid)"
            args = (*args, unsaid)
        logger.log(level, msg, *args, exc_info=exc_info, stacklevel=2)
        return True


def quoted(text: str, limit: int = 200) -> str:
    """A peer's ``text`` as it may appear in a line: cut to ``limit`` bytes, then quoted
    with every control character escaped (``repr``), so that it can forge no line."""
    return repr(clip(text, limit))
