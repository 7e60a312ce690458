"""OpenTelemetry spans for tether requests, through the API package only.

:class:`RequestTracer` is an :class:`~tether.Observer`: ``on_open`` runs in the
handler's context, so each request's span starts as a child of whatever span is
current there (the incoming HTTP span of an instrumented server), and ends with
the request: outcome, abort reason, time to first output and total time as
attributes, an event at the first output and one for an abort, and an error
status when the producer failed it. A batch gets a span of its own with one child
per sub-request; it ends when the last sub-request does.

Without an SDK (the global provider is still the API's proxy) the tracer starts
no span at all: it looks for a provider at most once a second, so that one set
later is used within a second, and until then a request costs a clock read. An
explicit provider is used as given. Spans are kept in a dict by rid between the
hooks, never on the request's state.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Final

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

import tether

__all__ = ["RequestTracer"]

_SCOPE: Final = "tether"

_LOOK_INTERVAL: Final = 1.0
"""Seconds between two looks for a global provider, while none is set."""

RID: Final = "tether.rid"
REQUEST_ID: Final = "tether.request_id"
OUTCOME: Final = "tether.outcome"
ABORT_REASON: Final = "tether.abort_reason"
TTFO: Final = "tether.time_to_first_output"
OUTPUT_COUNT: Final = "tether.output_count"
TOTAL: Final = "tether.total_time"
BATCH_SIZE: Final = "tether.batch.size"
BATCH_INDEX: Final = "tether.batch.index"


class _Batch:
    """A batch's span and how many of its sub-requests are still open."""

    __slots__ = ("outcome", "reason", "remaining", "span")

    def __init__(self, span: Span, size: int) -> None:
        self.span = span
        self.remaining = size
        self.outcome = tether.Outcome.FINISHED
        self.reason: str | None = None


class RequestTracer(tether.Observer):
    """Traces every request of the registries it is attached to.

    :param tracer_provider: where spans go; the global provider by default
        (``opentelemetry.trace.set_tracer_provider``), looked for until one is set.
    """

    __slots__ = ("_next_look", "_spans", "_tracer")

    def __init__(self, tracer_provider: trace.TracerProvider | None = None) -> None:
        self._tracer: Tracer | None = None
        if tracer_provider is not None:
            self._tracer = tracer_provider.get_tracer(_SCOPE, tether.__version__)
        self._next_look = 0.0
        self._spans: dict[str, tuple[Span, _Batch | None]] = {}

    def _find_tracer(self) -> Tracer | None:
        """The global provider's tracer, once an SDK has set one; looked for at most
        once per :data:`_LOOK_INTERVAL` until then."""
        now = time.monotonic()
        if now < self._next_look:
            return None
        self._next_look = now + _LOOK_INTERVAL
        provider = trace.get_tracer_provider()
        if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
            return None
        self._tracer = tracer = provider.get_tracer(_SCOPE, tether.__version__)
        return tracer

    def on_open(self, rids: Sequence[str], *, batch: bool, request_id: str | None) -> None:
        tracer = self._tracer or self._find_tracer()
        if tracer is None:
            return
        if not batch:
            span = tracer.start_span("tether.request", kind=SpanKind.INTERNAL)
            if span.is_recording():
                span.set_attribute(RID, rids[0])
                if request_id is not None:
                    span.set_attribute(REQUEST_ID, request_id)
                self._spans[rids[0]] = (span, None)
            return
        parent = tracer.start_span("tether.batch", kind=SpanKind.INTERNAL)
        if not parent.is_recording():
            return
        parent.set_attribute(BATCH_SIZE, len(rids))
        if request_id is not None:
            parent.set_attribute(REQUEST_ID, request_id)
        group = _Batch(parent, len(rids))
        context = trace.set_span_in_context(parent)
        for index, rid in enumerate(rids):
            span = tracer.start_span("tether.request", context=context, kind=SpanKind.INTERNAL)
            span.set_attribute(RID, rid)
            span.set_attribute(BATCH_INDEX, index)
            if request_id is not None:
                span.set_attribute(REQUEST_ID, request_id)
            self._spans[rid] = (span, group)

    def on_first_output(self, rid: str, elapsed: float) -> None:
        entry = self._spans.get(rid)
        if entry is not None:
            entry[0].add_event("tether.first_output")

    def on_end(self, end: tether.RequestEnd) -> None:
        entry = self._spans.pop(end.rid, None)
        if entry is None:
            return
        span, group = entry
        _close(span, end.outcome, end.reason, end.error)
        if end.time_to_first_output is not None:
            span.set_attribute(TTFO, end.time_to_first_output)
        span.set_attribute(TOTAL, end.total_time)
        span.set_attribute(OUTPUT_COUNT, end.outputs)
        span.end()
        if group is None:
            return
        if group.outcome is tether.Outcome.FINISHED and end.outcome is not tether.Outcome.FINISHED:
            group.outcome, group.reason = end.outcome, end.reason  # the first to go wrong
        group.remaining -= 1
        if group.remaining == 0:
            _close(group.span, group.outcome, group.reason, None)
            group.span.end()


def _close(
    span: Span, outcome: tether.Outcome, reason: str | None, error: BaseException | None
) -> None:
    span.set_attribute(OUTCOME, str(outcome))
    if outcome is tether.Outcome.ABORTED:
        span.set_attribute(ABORT_REASON, reason or "")
        span.add_event("tether.aborted", {ABORT_REASON: reason or ""})
    elif outcome is tether.Outcome.FAILED:
        description = type(error).__name__ if error is not None else "a sub-request failed"
        span.set_status(Status(StatusCode.ERROR, description))
