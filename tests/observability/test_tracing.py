"""OpenTelemetry spans, captured with the SDK's in-memory exporter: one span per
request (one per batch, with a child per sub-request), a child of the span current
where the request opened, with its rid, request id, outcome, abort reason and
timings; an event for the first output and for an abort."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import tether
import tether_otel


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


@pytest.fixture
def registry(provider: TracerProvider) -> tether.Registry:
    registry = tether.Registry()
    assert tether_otel.instrument(registry, tracer_provider=provider) is not None
    return registry


def by_name(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.name == name]


async def test_a_finished_request_is_a_child_of_the_http_span_with_its_timings(
    registry: tether.Registry, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    http = provider.get_tracer("server")
    with (
        http.start_as_current_span("POST /generate") as incoming,
        tether.RequestScope(request_id="client-7"),
    ):
        stream = registry.open()
        registry.deliver(stream.rid, "a")
        registry.deliver(stream.rid, "b", finished=True)
        async with asyncio.timeout(10):
            assert [out async for out in stream] == ["a", "b"]
    (span,) = by_name(exporter, "tether.request")
    assert span.parent is not None
    assert span.parent.span_id == incoming.get_span_context().span_id
    assert span.context.trace_id == incoming.get_span_context().trace_id
    attributes = dict(span.attributes or {})
    assert attributes["tether.rid"] == stream.rid
    assert attributes["tether.request_id"] == "client-7"
    assert attributes["tether.outcome"] == "finished"
    assert "tether.abort_reason" not in attributes
    ttfo, total = attributes["tether.time_to_first_output"], attributes["tether.total_time"]
    assert isinstance(ttfo, float)
    assert isinstance(total, float)
    assert 0 <= ttfo <= total
    assert [event.name for event in span.events] == ["tether.first_output"]
    assert span.status.status_code is StatusCode.UNSET


async def test_a_failed_request_ends_with_an_error_status(
    registry: tether.Registry, exporter: InMemorySpanExporter
) -> None:
    stream = registry.open()
    registry.fail(stream.rid, RuntimeError("engine broke"))
    (span,) = by_name(exporter, "tether.request")
    assert span.parent is None  # nothing was current: a root span
    assert dict(span.attributes or {})["tether.outcome"] == "failed"
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "ProducerError"
    await stream.aclose()


async def test_an_aborted_request_records_its_reason_and_an_abort_event(
    registry: tether.Registry, exporter: InMemorySpanExporter
) -> None:
    with tether.RequestScope() as scope:
        stream = registry.open()
        registry.deliver(stream.rid, "partial")
        scope.disconnect()
    (span,) = by_name(exporter, "tether.request")
    attributes = dict(span.attributes or {})
    assert attributes["tether.outcome"] == "aborted"
    assert attributes["tether.abort_reason"] == "client_disconnected"
    events = {event.name: dict(event.attributes or {}) for event in span.events}
    assert events["tether.aborted"] == {"tether.abort_reason": "client_disconnected"}
    assert "tether.first_output" in events
    assert span.status.status_code is StatusCode.UNSET  # a client leaving is no server error
    del stream


async def test_a_batch_is_one_span_with_a_child_per_sub_request(
    registry: tether.Registry, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    http = provider.get_tracer("server")
    with http.start_as_current_span("POST /generate") as incoming:
        batch = registry.open_batch(3)
        registry.deliver(batch.rids[0], "a", finished=True)
        assert not by_name(exporter, "tether.batch")  # open while sub-requests are
        registry.fail(batch.rids[1], RuntimeError("no"))  # the third: failed_sibling
    (parent,) = by_name(exporter, "tether.batch")
    assert parent.parent is not None
    assert parent.parent.span_id == incoming.get_span_context().span_id
    assert dict(parent.attributes or {})["tether.batch.size"] == 3
    assert dict(parent.attributes or {})["tether.outcome"] == "failed"
    assert parent.status.status_code is StatusCode.ERROR
    children = sorted(
        by_name(exporter, "tether.request"),
        key=lambda span: str(dict(span.attributes or {})["tether.batch.index"]),
    )
    assert [child.parent.span_id for child in children if child.parent] == [
        parent.context.span_id
    ] * 3
    outcomes = [dict(child.attributes or {})["tether.outcome"] for child in children]
    assert outcomes == ["finished", "failed", "aborted"]
    assert dict(children[2].attributes or {})["tether.abort_reason"] == "failed_sibling"
    assert [dict(c.attributes or {})["tether.rid"] for c in children] == list(batch.rids)
    await batch.aclose()


async def test_a_span_carries_the_number_of_outputs(
    registry: tether.Registry, exporter: InMemorySpanExporter
) -> None:
    stream = registry.open()
    for n in range(3):
        registry.deliver(stream.rid, n, finished=n == 2)
    (span,) = by_name(exporter, "tether.request")
    assert dict(span.attributes or {})["tether.output_count"] == 3
    await stream.aclose()


async def test_without_a_provider_nothing_is_recorded_and_requests_go_on() -> None:
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)  # no SDK set
    registry = tether.Registry()
    tracer = tether_otel.instrument(registry)
    assert tracer is not None
    stream = registry.open()
    registry.deliver(stream.rid, "x", finished=True)
    async with asyncio.timeout(10):
        assert await stream.result() == "x"
    assert registry.in_flight == 0


def test_without_the_api_installed_instrument_is_a_no_op() -> None:
    probe = (
        "import sys; sys.modules['opentelemetry'] = None\n"  # as if not installed
        "import asyncio, tether, tether_otel\n"
        "async def main():\n"
        "    registry = tether.Registry()\n"
        "    assert tether_otel.instrument(registry) is None\n"
        "    stream = registry.open()\n"
        "    registry.deliver(stream.rid, 1, finished=True)\n"
        "    assert await stream.result() == 1\n"
        "asyncio.run(main())\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.stdout.strip() == "ok", done.stderr


def test_a_global_provider_set_after_instrument_is_picked_up() -> None:
    probe = (
        "import asyncio, time, tether, tether_otel\n"
        "from opentelemetry import trace\n"
        "from opentelemetry.sdk.trace import TracerProvider\n"
        "from opentelemetry.sdk.trace.export import SimpleSpanProcessor\n"
        "from opentelemetry.sdk.trace.export.in_memory_span_exporter import "
        "InMemorySpanExporter\n"
        "async def main():\n"
        "    registry = tether.Registry()\n"
        "    tether_otel.instrument(registry)  # no provider yet\n"
        "    registry.abort(registry.open().rid)\n"
        "    exporter = InMemorySpanExporter()\n"
        "    provider = TracerProvider()\n"
        "    provider.add_span_processor(SimpleSpanProcessor(exporter))\n"
        "    trace.set_tracer_provider(provider)\n"
        "    deadline = time.monotonic() + 10\n"
        "    while not exporter.get_finished_spans():  # within about a second\n"
        "        assert time.monotonic() < deadline, 'the provider was never used'\n"
        "        registry.abort(registry.open().rid)\n"
        "        await asyncio.sleep(0.01)\n"
        "    print(exporter.get_finished_spans()[0].name)\n"
        "asyncio.run(main())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.stdout.strip() == "tether.request", done.stderr
