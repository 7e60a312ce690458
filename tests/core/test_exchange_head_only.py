"""Exchange.start(head_only=True): a HEAD request gets headers only and aborts the work."""

from __future__ import annotations

import tether
import tether.http


async def test_head_only_aborts_the_work_and_returns_the_streaming_headers() -> None:
    aborted: list[str] = []
    registry = tether.Registry(aborted.append)
    stream = registry.open()
    exchange = tether.http.Exchange(stream, streaming=True)

    head = await exchange.start(head_only=True)

    sse_headers = {
        "content-type": "text/event-stream; charset=utf-8",
        "cache-control": "no-cache",
        "x-accel-buffering": "no",
    }
    assert head == tether.http.Head(200, sse_headers, b"")
    assert aborted == [stream.rid]
    assert registry.in_flight == 0
    assert exchange.done
    assert await exchange.next_chunk() == b""


async def test_head_only_of_a_json_answer_has_the_json_content_type() -> None:
    registry = tether.Registry()
    batch = registry.open_batch(2)
    exchange = tether.http.Exchange(batch, streaming=False)

    head = await exchange.start(head_only=True)

    assert head == tether.http.Head(200, {"content-type": "application/json"}, b"")
    assert registry.in_flight == 0
