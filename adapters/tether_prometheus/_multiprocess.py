"""tether's metrics in ``prometheus_client``'s multiprocess mode.

With several worker processes behind one port, a scrape reaches one worker at
random; ``prometheus_client`` solves that with files: every worker writes its
metric values under ``PROMETHEUS_MULTIPROC_DIR`` and whichever worker is scraped
sums them all (``prometheus_client.multiprocess.MultiProcessCollector``). A
custom collector's scrape-time values never reach those files, so in this mode
tether's metrics are ordinary ``prometheus_client`` metric objects, updated by an
:class:`~tether.Observer` when a request opens, gets its first output and ends
(never per output). Late outputs have no hook: their count is carried over on
each of those events.

The in-flight gauge sums the live workers (``livesum``): call
``prometheus_client.multiprocess.mark_process_dead(pid)`` when a worker exits, as
the multiprocess mode asks for every such gauge.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import Counter, Gauge, Histogram

import tether

from ._collector import DURATION_BUCKETS, TTFO_BUCKETS, check_buckets, describe

__all__ = ["MultiprocessMetrics"]


class MultiprocessMetrics:
    """tether's metrics as ``prometheus_client`` metric objects, for multiprocess mode.

    Create one per worker process, after the fork, and :meth:`add` the worker's
    registries; expose them from any worker with a ``CollectorRegistry`` holding a
    ``MultiProcessCollector``. Outside multiprocess mode these objects work too, but
    :class:`RegistryCollector` is cheaper there.

    :param ttfo_buckets: upper bounds, in seconds, of the time-to-first-output histogram.
    :param duration_buckets: upper bounds, in seconds, of the total-time histogram.
    """

    def __init__(
        self,
        *,
        ttfo_buckets: Sequence[float] = TTFO_BUCKETS,
        duration_buckets: Sequence[float] = DURATION_BUCKETS,
    ) -> None:
        label = ["registry"]
        # registry=None: the values live in the multiprocess files, not in a
        # process-wide collector registry (two instances must not clash there).
        self.in_flight = Gauge(
            *describe("requests_in_flight"), label, registry=None, multiprocess_mode="livesum"
        )
        self.opened = Counter(*describe("requests_opened"), label, registry=None)
        self.finished = Counter(*describe("requests_finished"), label, registry=None)
        self.failed = Counter(*describe("requests_failed"), label, registry=None)
        self.aborted = Counter(*describe("requests_aborted"), ["registry", "reason"], registry=None)
        self.late = Counter(*describe("late_outputs"), label, registry=None)
        self.ttfo = Histogram(
            *describe("time_to_first_output_seconds"),
            label,
            registry=None,
            buckets=check_buckets(ttfo_buckets),
        )
        self.duration = Histogram(
            *describe("request_duration_seconds"),
            label,
            registry=None,
            buckets=check_buckets(duration_buckets),
        )
        self._names: set[str] = set()

    def add(self, registry: tether.Registry, *, name: str = "default") -> None:
        """Count ``registry``'s requests from now on, under ``registry="<name>"``.

        Add it before the worker serves: the in-flight gauge counts opens and ends
        it saw, so requests already open would take it below zero when they end.

        :raises ValueError: ``name`` is taken.
        """
        if name in self._names:
            raise ValueError(f"a registry named {name!r} is already counted here")
        self._names.add(name)
        registry.add_observer(_Recorder(self, registry, name))


class _Recorder(tether.Observer):
    """Updates one registry's labelled children (resolved once, not per request)."""

    __slots__ = (
        "aborted",
        "duration",
        "failed",
        "finished",
        "in_flight",
        "late",
        "late_seen",
        "opened",
        "registry",
        "ttfo",
    )

    def __init__(self, metrics: MultiprocessMetrics, registry: tether.Registry, name: str) -> None:
        self.registry = registry
        self.in_flight = metrics.in_flight.labels(name)
        self.opened = metrics.opened.labels(name)
        self.finished = metrics.finished.labels(name)
        self.failed = metrics.failed.labels(name)
        self.aborted = {
            str(reason): metrics.aborted.labels(name, str(reason)) for reason in tether.AbortReason
        }
        self.late = metrics.late.labels(name)
        self.late_seen = registry.late_outputs
        self.ttfo = metrics.ttfo.labels(name)
        self.duration = metrics.duration.labels(name)
        for child in (self.in_flight, self.opened, self.finished, self.failed, self.late):
            child.inc(0)  # every series exists from the start, at zero
        for child in self.aborted.values():
            child.inc(0)

    def _carry_late(self) -> None:
        late = self.registry.late_outputs
        if late != self.late_seen:
            self.late.inc(late - self.late_seen)
            self.late_seen = late

    def on_open(self, rids: Sequence[str], *, batch: bool, request_id: str | None) -> None:
        self.opened.inc(len(rids))
        self.in_flight.inc(len(rids))
        self._carry_late()

    def on_first_output(self, rid: str, elapsed: float) -> None:
        self.ttfo.observe(elapsed)

    def on_end(self, end: tether.RequestEnd) -> None:
        self.in_flight.dec()
        if end.outcome is tether.Outcome.FINISHED:
            self.finished.inc()
        elif end.outcome is tether.Outcome.FAILED:
            self.failed.inc()
        else:
            self.aborted[end.reason or str(tether.AbortReason.SERVER)].inc()
        self.duration.observe(end.total_time)
        self._carry_late()
