"""Exchange.start_head_only: a HEAD request gets headers only and aborts the work."""

from __future__ import annotations

import tether


async def test_head_only_aborts_the_work_and_returns_the_streaming_headers() -> None:
    aborted: list[str] = []
    registry = tether.Registry(aborted.append)
    stream = registry.open()
    exchange = tether.Exchange(stream, streaming=True)

    head = await exchange.start_head_only()

    sse_headers = {
        "content-type": "text/event-stream",
        "cache-control": "no-cache",
        "x-accel-buffering": "no",
    }
    assert head == tether.Head(200, sse_headers, b"", False)
    assert aborted == [stream.rid]
    assert registry.in_flight == 0
    assert await exchange.next_chunk() is None


async def test_head_only_of_a_json_answer_has_the_json_content_type() -> None:
    registry = tether.Registry()
    batch = registry.open_batch(2)
    exchange = tether.Exchange(batch, streaming=False)

    head = await exchange.start_head_only()

    assert head == tether.Head(200, {"content-type": "application/json"}, b"", False)
    assert registry.in_flight == 0
