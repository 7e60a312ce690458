"""Registry statistics: a frozen snapshot and the bounded sample it summarises."""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["RegistryStats", "Summary"]

_SAMPLES = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class Summary:
    """Summary of a duration, in seconds, over the most recent requests.

    :param count: how many requests the figures describe (at most the last 4096).
    :param mean: arithmetic mean.
    :param p50: median.
    :param p90: 90th percentile.
    :param p99: 99th percentile.
    :param max: largest sample.
    """

    count: int = 0
    mean: float = 0.0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    max: float = 0.0

    @classmethod
    def of(cls, samples: collections.deque[float]) -> Summary:
        if not samples:
            return cls()
        ordered = sorted(samples)
        n = len(ordered)

        def pct(q: float) -> float:
            return ordered[min(n - 1, max(0, math.ceil(q * n) - 1))]

        return cls(n, sum(ordered) / n, pct(0.5), pct(0.9), pct(0.99), ordered[-1])


def sample_buffer() -> collections.deque[float]:
    return collections.deque(maxlen=_SAMPLES)


@dataclasses.dataclass(frozen=True, slots=True)
class RegistryStats:
    """A snapshot of a :class:`~tether.Registry`'s counters, from ``Registry.stats()``.

    :param opened: requests registered by ``open()``/``open_batch()`` (each sub-request counts).
    :param finished: requests the producer finished (``deliver(..., finished=True)``).
    :param failed: requests the producer failed (``fail()``).
    :param aborted: requests closed before they finished, by :class:`~tether.AbortReason` value.
    :param late_outputs: producer calls (deliver, fail, abort) for a rid no longer in flight.
    :param in_flight: requests registered now.
    :param max_in_flight: the admission limit, or ``None`` for none.
    :param closed: whether ``close()`` has begun.
    :param time_to_first_output: from ``open()`` to the first ``deliver()``.
    :param total_time: from ``open()`` to the request's end, whatever the end was.
    """

    opened: int
    finished: int
    failed: int
    aborted: Mapping[str, int]
    late_outputs: int
    in_flight: int
    max_in_flight: int | None
    closed: bool
    time_to_first_output: Summary
    total_time: Summary

    @property
    def aborted_total(self) -> int:
        """All aborted requests, whatever the reason."""
        return sum(self.aborted.values())

    def as_dict(self) -> dict[str, Any]:
        """The snapshot as plain JSON-ready data (for a ``/metrics`` endpoint)."""
        # asdict() would deep-copy ``aborted``, a read-only mapping proxy it cannot copy.
        data = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        data["aborted"] = dict(self.aborted)
        data["time_to_first_output"] = dataclasses.asdict(self.time_to_first_output)
        data["total_time"] = dataclasses.asdict(self.total_time)
        return data
