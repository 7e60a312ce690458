"""A write the producer's step began (its first step suspended, the write loop
finished it) is let go of once written, as every other chunk: an idle stream keeps
none of the chunks it wrote."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Coroutine
from typing import Any

import tether
import tether.http
from tests._support.direct_writes import DirectTransport, parked

SIZE = 200_000
"""An output's bytes: only the chunk that frames it holds it whole."""


class SuspendingTransport(DirectTransport):
    """A direct write whose every step suspends once: each write is begun, and the
    write loop finishes it (``finished`` is set when it did)."""

    def __init__(self) -> None:
        super().__init__()
        self.finished = asyncio.Event()

    def write(self, chunk: bytes) -> Coroutine[Any, Any, None]:  # type: ignore[override]
        async def rest() -> None:
            await asyncio.sleep(0)  # (the suspended step: a checkpoint in the send chain)
            self.written.append(chunk)
            self.finished.set()

        return rest()


def holders_of_a_written_chunk() -> list[str]:
    gc.collect()
    return [
        type(holder).__name__
        for holder in gc.get_objects()
        for held in gc.get_referents(holder)
        if type(held) is bytes and len(held) > SIZE and held.startswith(b"data: {")
    ]


async def test_a_finished_begun_write_keeps_no_chunk_while_the_stream_idles() -> None:
    registry = tether.Registry()
    stream = registry.open()
    exchange = tether.http.Exchange(stream, streaming=True)
    registry.deliver(stream.rid, "first")
    head = await exchange.start()
    sink = SuspendingTransport()
    writer, running = await parked(exchange, head.body, sink)
    del head
    assert registry.deliver(stream.rid, {"big": "b" * SIZE})
    async with asyncio.timeout(10):
        await sink.finished.wait()  # (the loop finished it and waits again: it is idle)
    assert len(sink.written) == 1
    assert len(sink.written[0]) > SIZE
    sink.written.clear()  # (the test's own record of it)
    assert holders_of_a_written_chunk() == []
    assert registry.deliver(stream.rid, "last", finished=True)
    async with asyncio.timeout(10):
        await running
    assert writer.framed[-1] == (b'data: "last"\n\ndata: [DONE]\n\n', True)
