"""Prometheus metrics of tether registries, read at scrape time.

:class:`RegistryCollector` is a ``prometheus_client`` custom collector: the
counters and the in-flight gauge are the registry's own, read when Prometheus
scrapes, so the request path pays nothing for them. Histograms cannot be read
from a counter: an :class:`~tether.Observer` adds each time to first output (once
per request, when it arrives) and each total time (when the request ends) to
cumulative bucket counts, a bisect and an increment, no lock (everything runs on
the registry's loop).

Several registries go into one collector, each under its own ``registry`` label,
so they add up in a query (``sum by (le)``) rather than clash on metric names.
Several worker processes (gunicorn, ``uvicorn --workers``) need the multiprocess
mode instead: see :class:`MultiprocessMetrics`.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Final

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

import tether

__all__ = [
    "DURATION_BUCKETS",
    "TTFO_BUCKETS",
    "RegistryCollector",
    "check_buckets",
    "describe",
]

TTFO_BUCKETS: Final[tuple[float, ...]] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
    0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
"""Default upper bounds, in seconds, for the time to first output: an LLM's first
token comes in milliseconds when warm and in tens of seconds behind a long queue."""

DURATION_BUCKETS: Final[tuple[float, ...]] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0, 1200.0,
)  # fmt: skip
"""Default upper bounds, in seconds, for a request's total time: from a one-token
answer to a long generation."""

_PREFIX: Final = "tether_"

# name (without prefix) -> help text; the one table both modes expose.
HELP: Final = {
    "requests_in_flight": "Requests registered now (open and not yet ended).",
    "requests_opened": "Requests registered, each sub-request of a batch counted.",
    "requests_finished": "Requests the producer finished.",
    "requests_failed": "Requests the producer failed.",
    "requests_aborted": "Requests closed before they finished, by reason.",
    "late_outputs": "Producer calls for a request no longer in flight.",
    "time_to_first_output_seconds": "Time from opening a request to its first output.",
    "request_duration_seconds": "Time from opening a request to its end, whatever the end.",
}


def describe(name: str) -> tuple[str, str]:
    """The full metric name and help text of one of tether's metrics."""
    return _PREFIX + name, HELP[name]


def check_buckets(bounds: Sequence[float]) -> tuple[float, ...]:
    """Validated finite upper bounds, strictly increasing (``+Inf`` is implied).

    :raises ValueError: empty, not increasing, or not finite.
    """
    finite = tuple(float(bound) for bound in bounds if not math.isinf(bound))
    if not finite:
        raise ValueError("a histogram needs at least one finite bucket bound")
    if any(not b > a for a, b in itertools.pairwise(finite)):
        raise ValueError(f"bucket bounds must increase strictly, got {list(bounds)}")
    if any(math.isnan(bound) for bound in finite):
        raise ValueError("a bucket bound cannot be NaN")
    return finite


class _Histogram:
    """Bucket counts (per bucket, made cumulative at scrape time), sum and count."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        buckets: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            running += count
            buckets.append((_bound_label(bound), running))
        buckets.append(("+Inf", running + self.counts[-1]))
        return buckets


def _bound_label(bound: float) -> str:
    # prometheus_client's own form: 0.5 -> "0.5", 1 -> "1.0"
    return repr(float(bound))


class _Timings(tether.Observer):
    """The observer that feeds one registry's two histograms."""

    __slots__ = ("duration", "ttfo")

    def __init__(self, ttfo: tuple[float, ...], duration: tuple[float, ...]) -> None:
        self.ttfo = _Histogram(ttfo)
        self.duration = _Histogram(duration)

    def on_first_output(self, rid: str, elapsed: float) -> None:
        self.ttfo.observe(elapsed)

    def on_end(self, end: tether.RequestEnd) -> None:
        self.duration.observe(end.total_time)


class RegistryCollector(Collector):
    """Exposes the metrics of one or more :class:`tether.Registry` to Prometheus.

    ::

        collector = RegistryCollector()
        collector.add(registry, name="engine")
        prometheus_client.REGISTRY.register(collector)

    :param ttfo_buckets: upper bounds, in seconds, of the time-to-first-output
        histogram (``+Inf`` is implied).
    :param duration_buckets: upper bounds, in seconds, of the total-time histogram.
    :raises ValueError: bucket bounds that are empty or not increasing.
    """

    def __init__(
        self,
        *,
        ttfo_buckets: Sequence[float] = TTFO_BUCKETS,
        duration_buckets: Sequence[float] = DURATION_BUCKETS,
    ) -> None:
        self._ttfo_bounds = check_buckets(ttfo_buckets)
        self._duration_bounds = check_buckets(duration_buckets)
        self._tracked: dict[str, tuple[tether.Registry, _Timings]] = {}

    def add(self, registry: tether.Registry, *, name: str = "default") -> None:
        """Start exposing ``registry`` under the label ``registry="<name>"``.

        Histograms count from now on; the counters are the registry's since it was made.

        :raises ValueError: ``name`` is taken in this collector.
        """
        if name in self._tracked:
            raise ValueError(f"a registry named {name!r} is already in this collector")
        timings = _Timings(self._ttfo_bounds, self._duration_bounds)
        registry.add_observer(timings)
        self._tracked[name] = (registry, timings)

    def remove(self, name: str) -> None:
        """Stop exposing the registry added under ``name`` (and detach from it).

        :raises KeyError: no registry was added under ``name``.
        """
        registry, timings = self._tracked.pop(name)
        registry.remove_observer(timings)

    def describe(self) -> Iterable[Metric]:
        """The metric families, without samples: what ``register()`` checks for clashes."""
        return _Families().all()

    def collect(self) -> Iterable[Metric]:
        """Every metric, read now from each registry (called at each scrape)."""
        families = _Families()
        for name, (registry, timings) in self._tracked.items():
            stats = registry.stats()
            label = [name]
            families.in_flight.add_metric(label, stats.in_flight)
            families.opened.add_metric(label, stats.opened)
            families.finished.add_metric(label, stats.finished)
            families.failed.add_metric(label, stats.failed)
            for reason in tether.AbortReason:
                count = stats.aborted.get(str(reason), 0)
                families.aborted.add_metric([name, str(reason)], count)
            families.late.add_metric(label, stats.late_outputs)
            ttfo, duration = timings.ttfo, timings.duration
            families.ttfo.add_metric(label, ttfo.cumulative(), ttfo.sum)
            families.duration.add_metric(label, duration.cumulative(), duration.sum)
        return families.all()


class _Families:
    """One scrape's metric families, to be filled with each registry's samples."""

    __slots__ = ("aborted", "duration", "failed", "finished", "in_flight", "late", "opened", "ttfo")

    def __init__(self) -> None:
        label = ["registry"]
        self.in_flight = GaugeMetricFamily(*describe("requests_in_flight"), labels=label)
        self.opened = CounterMetricFamily(*describe("requests_opened"), labels=label)
        self.finished = CounterMetricFamily(*describe("requests_finished"), labels=label)
        self.failed = CounterMetricFamily(*describe("requests_failed"), labels=label)
        self.aborted = CounterMetricFamily(
            *describe("requests_aborted"), labels=["registry", "reason"]
        )
        self.late = CounterMetricFamily(*describe("late_outputs"), labels=label)
        self.ttfo = HistogramMetricFamily(*describe("time_to_first_output_seconds"), labels=label)
        self.duration = HistogramMetricFamily(*describe("request_duration_seconds"), labels=label)

    def all(self) -> list[Metric]:
        return [
            self.in_flight,
            self.opened,
            self.finished,
            self.failed,
            self.aborted,
            self.late,
            self.ttfo,
            self.duration,
        ]
