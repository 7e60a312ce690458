"""The byte budget of a resumable stream's log (``_resume_log``): what its events weigh,
so that the bytes waiting for a client, and the bytes kept, are known in O(1).

Outputs are weighed once, by :func:`~tether.approximate_size`, as they are recorded;
a running sum per event held makes the weight of any span a subtraction.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any

from ._limits import approximate_size

__all__ = ["Weights"]


class Weights:
    """The running byte sums of a log's events.

    :param budget: how many bytes may wait for a client, and about how many are kept.
    """

    __slots__ = ("base", "budget", "sums")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.sums: list[int] = []
        """The bytes of every event up to each one held (the first held is ``first``)."""
        self.base = 0
        """The bytes of every event before the first held."""

    def preload(self, events: list[Any]) -> None:
        """Weigh a backlog read elsewhere (the log starts with it)."""
        self.sums = list(itertools.accumulate(map(approximate_size, events)))

    def add(self, outputs: list[Any], unsent: int) -> bool:
        """Weigh new events; whether the last ``unsent`` of all held outweigh the budget."""
        sums = self.sums
        total = sums[-1] if sums else self.base
        for output in outputs:
            total += approximate_size(output)
            sums.append(total)
        index = len(sums) - unsent - 1
        through = self.base if index < 0 else sums[index]
        return total - through > self.budget

    def excess(self) -> int:
        """How many of the oldest events to forget so that about the budget is held;
        ``0`` until half as much again is held (so that forgetting costs O(1) per event)."""
        sums = self.sums
        if not sums or sums[-1] - self.base <= self.budget + (self.budget >> 1):
            return 0
        return bisect.bisect_right(sums, sums[-1] - self.budget)

    def drop(self, count: int) -> None:
        """The oldest ``count`` events are forgotten."""
        self.base = self.sums[count - 1]
        del self.sums[:count]
