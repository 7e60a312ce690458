"""SSE's optional fields: ``retry:`` at the start, an ``id:`` per output, a named error
event; none of them unless asked, so the default framing stays byte for byte."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import pytest

import tether
import tether.http


def test_default_sse_writes_no_optional_field() -> None:
    sse = tether.SSE()
    body = tether.http.error_body(tether.RegistryClosed(), 503)
    assert sse.preamble() == b""
    assert sse.error(body) == b"data: " + sse.dumps(body) + b"\n\n"
    assert sse.encode_many([1]) == b"data: 1\n\n"


def test_retry_is_written_as_its_own_field() -> None:
    assert tether.SSE(retry=2500).preamble() == b"retry: 2500\n\n"
    assert tether.SSE(retry=0).preamble() == b"retry: 0\n\n"


def test_each_output_carries_its_event_id() -> None:
    data = tether.SSE().encode_events([("t.1", {"text": "a"}), ("t.2", "b")])
    assert data == b'id: t.1\ndata: {"text":"a"}\n\nid: t.2\ndata: "b"\n\n'


def test_the_error_event_is_named_when_asked() -> None:
    body = tether.http.error_body(tether.RegistryClosed(), 503)
    named = tether.SSE(error_event="error").error(body)
    assert named == b"event: error\ndata: " + tether.SSE().dumps(body) + b"\n\n"
    assert tether.SSE().error(body, event="error") == named


def test_ndjson_has_no_event_ids() -> None:
    assert not tether.NDJSON.has_event_ids
    assert tether.SSE.has_event_ids
    with pytest.raises(TypeError, match="resumable streams need SSE"):
        tether.NDJSON().encode_events([("1", 1)])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"retry": -1}, "milliseconds"),
        ({"retry": True}, "milliseconds"),
        ({"error_event": "a\nb"}, "line break"),
        ({"error_event": "a\rb"}, "line break"),
    ],
    ids=["negative-retry", "bool-retry", "newline-event", "cr-event"],
)
def test_fields_that_would_break_the_framing_are_refused(
    options: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        tether.SSE(**options)  # type: ignore[arg-type]


async def test_a_stream_starts_with_the_retry_field_then_its_outputs() -> None:
    registry = tether.Registry()
    stream = registry.open()
    registry.deliver(stream.rid, {"n": 1})
    exchange = tether.http.Exchange(stream, streaming=True, encoder=tether.SSE(retry=1000))
    async with asyncio.timeout(10):
        head = await exchange.start()
    assert head.body == b'retry: 1000\n\ndata: {"n":1}\n\n'
    registry.deliver(stream.rid, {"n": 2}, finished=True)
    async with asyncio.timeout(10):
        assert await exchange.next_chunk() == b'data: {"n":2}\n\ndata: [DONE]\n\n'
    await exchange.aclose()
    assert registry.in_flight == 0


async def test_a_stream_over_before_it_started_still_opens_with_retry() -> None:
    registry = tether.Registry()
    stream = registry.open()
    registry.deliver(stream.rid, "x", finished=True)
    exchange = tether.http.Exchange(stream, streaming=True, encoder=tether.SSE(retry=5))
    async with asyncio.timeout(10):
        head = await exchange.start()
    assert head.body == b'retry: 5\n\ndata: "x"\n\ndata: [DONE]\n\n'
    assert exchange.done


def test_a_subclass_that_shapes_its_outputs_keeps_its_shape_with_ids() -> None:
    class Wrapped(tether.SSE):
        def encode_many(self, outputs: Iterable[Any]) -> bytes:
            return super().encode_many([{"wrapped": output} for output in outputs])

    assert Wrapped().encode_events([("t.1", 1), ("t.2", 2)]) == (
        b'id: t.1\ndata: {"wrapped":1}\n\nid: t.2\ndata: {"wrapped":2}\n\n'
    )
