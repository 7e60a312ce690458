"""A producer-side write that the transport declines (its buffer filled) hands the
outputs back to the write loop untouched: each output is shaped and encoded once,
whichever of the two writes it."""

from __future__ import annotations

import asyncio
from collections import Counter

import tether
import tether.http
from tests._support.direct_writes import DirectTransport, started_and_parked


async def test_an_output_the_transport_declines_is_shaped_once(registry: tether.Registry) -> None:
    shaped: Counter[str] = Counter()

    def transform(output: str) -> str:
        shaped[output] += 1
        return output.upper()

    async with asyncio.timeout(10):
        # The client reads slowly: one direct write fills the kernel's buffer.
        full_after_one = DirectTransport(room=1)
        stream, _, writer, running = await started_and_parked(
            registry, full_after_one, transform=transform
        )
        registry.deliver(stream.rid, "second")  # written by the sink: the buffer fills
        registry.deliver(stream.rid, "third")  # declined: the write loop writes it
        registry.deliver(stream.rid, "last", finished=True)
        await running
    body = writer.body()
    assert (
        body
        == b'data: "FIRST"\n\ndata: "SECOND"\n\ndata: "THIRD"\n\ndata: "LAST"\n\ndata: [DONE]\n\n'
    )
    assert shaped == dict.fromkeys(["first", "second", "third", "last"], 1)
    assert registry.in_flight == 0
