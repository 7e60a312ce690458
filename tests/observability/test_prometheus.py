"""The Prometheus collector: after a known sequence of requests, every metric the
exposition holds (parsed back with prometheus_client's own parser) has the value
the sequence implies; several registries add up under their own label."""

from __future__ import annotations

import asyncio
import bisect
import math
from collections.abc import Sequence

import prometheus_client
import pytest

import tether
import tether_prometheus
from tests._support.observers import Recorder
from tests._support.scrape import Scrape

REASONS = [str(reason) for reason in tether.AbortReason]


def scrape(*collectors: prometheus_client.registry.Collector) -> Scrape:
    registry = prometheus_client.CollectorRegistry()
    for collector in collectors:
        registry.register(collector)
    return Scrape(prometheus_client.generate_latest(registry).decode())


def expected_buckets(values: Sequence[float], bounds: Sequence[float]) -> dict[float, float]:
    """Cumulative counts of ``values`` under each bound (``le``: at most), and +Inf."""
    ordered = sorted(values)
    found = {float(bound): float(bisect.bisect_right(ordered, bound)) for bound in bounds}
    found[math.inf] = float(len(ordered))
    return found


async def known_sequence(registry: tether.Registry) -> tether.Stream:
    """Three finished (one single, a batch of two), one failed, one abort for each
    reason, two late outputs; returns the one request left in flight."""
    async with asyncio.timeout(10):
        single = registry.open()
        registry.deliver(single.rid, "b", finished=True)
        assert await single.result() == "b"

        batch = registry.open_batch(2)
        for rid in batch.rids:
            registry.deliver(rid, "x", finished=True)
        assert await batch.result() == ["x", "x"]

        with tether.RequestScope() as scope:
            gone = registry.open()
            scope.disconnect()  # client_disconnected
        closed = registry.open()
        await closed.aclose()  # cancelled
        late = registry.open(timeout=0.01)
        with pytest.raises(tether.RequestTimeout):
            await late.result()  # timeout
        slow = registry.open()
        for n in range(2):  # max_pending=1: the second waiting output is one too many
            registry.deliver(slow.rid, n)
        with pytest.raises(tether.ConsumerTooSlow):
            await slow.result()  # consumer_too_slow
        aborted = registry.open()
        registry.abort(aborted.rid)  # server
        siblings = registry.open_batch(2)
        registry.fail(siblings.rids[0], RuntimeError("engine broke"))  # failed + failed_sibling
        with pytest.raises(tether.ProducerError):
            await siblings.result()
        del gone

        assert registry.deliver(single.rid, "after the end") is False
        assert registry.fail("never-opened", RuntimeError()) is False
        return registry.open()


async def test_every_metric_counts_a_known_sequence_of_requests() -> None:
    registry = tether.Registry(max_pending=1)
    times = Recorder()
    registry.add_observer(times)
    collector = tether_prometheus.RegistryCollector()
    collector.add(registry, name="main")
    still_open = await known_sequence(registry)

    got = scrape(collector)
    label = {"registry": "main"}
    assert got.value("tether_requests_in_flight", **label) == 1
    assert got.value("tether_requests_opened_total", **label) == 11
    assert got.value("tether_requests_finished_total", **label) == 3
    assert got.value("tether_requests_failed_total", **label) == 1
    for reason in REASONS:
        assert got.value("tether_requests_aborted_total", reason=reason, **label) == 1, reason
    assert got.value("tether_late_outputs_total", **label) == 2

    ttfo = [elapsed for _, elapsed in times.firsts]
    assert len(ttfo) == 4  # the single, the batch's two, the slow one
    name = "tether_time_to_first_output_seconds"
    assert got.buckets(name, **label) == expected_buckets(ttfo, tether_prometheus.TTFO_BUCKETS)
    assert got.value(f"{name}_count", **label) == 4
    assert got.value(f"{name}_sum", **label) == pytest.approx(sum(ttfo))

    totals = [end.total_time for end in times.ends.values()]
    assert len(totals) == 10  # every request but the open one
    name = "tether_request_duration_seconds"
    bounds = tether_prometheus.DURATION_BUCKETS
    assert got.buckets(name, **label) == expected_buckets(totals, bounds)
    assert got.value(f"{name}_count", **label) == 10
    assert got.value(f"{name}_sum", **label) == pytest.approx(sum(totals))
    await still_open.aclose()


async def test_metric_names_types_and_help_follow_prometheus_conventions() -> None:
    registry = tether.Registry()
    collector = tether_prometheus.RegistryCollector()
    collector.add(registry)
    got = scrape(collector)
    kinds = {name: family.type for name, family in got.families.items()}
    assert kinds == {
        "tether_requests_in_flight": "gauge",
        "tether_requests_opened": "counter",
        "tether_requests_finished": "counter",
        "tether_requests_failed": "counter",
        "tether_requests_aborted": "counter",
        "tether_late_outputs": "counter",
        "tether_time_to_first_output_seconds": "histogram",
        "tether_request_duration_seconds": "histogram",
    }
    assert all(family.documentation for family in got.families.values())
    for reason in REASONS:  # every reason is a series from the start, at zero
        assert got.value("tether_requests_aborted_total", registry="default", reason=reason) == 0


async def test_configured_buckets_are_the_exposed_bounds() -> None:
    registry = tether.Registry()
    collector = tether_prometheus.RegistryCollector(
        ttfo_buckets=[0.5, 1.0], duration_buckets=[2.0, math.inf]
    )
    collector.add(registry)
    stream = registry.open()
    registry.deliver(stream.rid, 1, finished=True)
    got = scrape(collector)
    ttfo = got.buckets("tether_time_to_first_output_seconds", registry="default")
    assert ttfo == {0.5: 1.0, 1.0: 1.0, math.inf: 1.0}
    assert got.buckets("tether_request_duration_seconds", registry="default") == {
        2.0: 1.0,
        math.inf: 1.0,
    }
    await stream.aclose()


@pytest.mark.parametrize(
    "bounds", [[], [1.0, 1.0], [2.0, 1.0], [math.nan]], ids=["empty", "equal", "down", "nan"]
)
def test_bucket_bounds_that_are_not_increasing_are_refused(bounds: list[float]) -> None:
    with pytest.raises(ValueError, match="bucket"):
        tether_prometheus.RegistryCollector(ttfo_buckets=bounds)


async def test_two_registries_are_exposed_side_by_side_and_add_up() -> None:
    first, second = tether.Registry(), tether.Registry()
    collector = tether_prometheus.RegistryCollector()
    collector.add(first, name="chat")
    collector.add(second, name="embed")
    with pytest.raises(ValueError, match="already"):
        collector.add(second, name="chat")
    for registry, count in ((first, 2), (second, 3)):
        for _ in range(count):
            stream = registry.open()
            registry.deliver(stream.rid, 1, finished=True)
    got = scrape(collector)
    assert got.value("tether_requests_finished_total", registry="chat") == 2
    assert got.value("tether_requests_finished_total", registry="embed") == 3
    chat = got.buckets("tether_request_duration_seconds", registry="chat")
    embed = got.buckets("tether_request_duration_seconds", registry="embed")
    assert chat[math.inf] + embed[math.inf] == 5

    collector.remove("embed")
    got = scrape(collector)
    with pytest.raises(KeyError):
        got.value("tether_requests_finished_total", registry="embed")
    stream = second.open()  # detached: no longer observed
    second.deliver(stream.rid, 1, finished=True)
    assert second.stats().finished == 4


def test_the_collector_registers_in_the_default_registry_without_clashing() -> None:
    collector = tether_prometheus.RegistryCollector()
    collector.add(tether.Registry())
    prometheus_client.REGISTRY.register(collector)
    try:
        text = prometheus_client.generate_latest().decode()
        assert 'tether_requests_opened_total{registry="default"} 0.0' in text
    finally:
        prometheus_client.REGISTRY.unregister(collector)
