"""A write loop cancelled (the server's shutdown) right after the producer's last output
still sends that output, before its farewell: the request finished, its client gets all
of it."""

from __future__ import annotations

import asyncio

import tether
import tether.http
from tests._support.direct_writes import started_and_parked


async def test_the_last_output_goes_out_before_the_farewell_of_a_cancelled_write_loop(
    registry: tether.Registry,
) -> None:
    async with asyncio.timeout(10):
        stream, _, writer, running = await started_and_parked(registry)
        registry.deliver(stream.rid, "second")
        registry.deliver(stream.rid, "last", finished=True)
        running.cancel()  # in the same step: the server's shutdown
        await asyncio.wait([running])
    body = writer.body()
    assert body.startswith(b'data: "first"\n\ndata: "second"\n\ndata: "last"\n\n'), body
    assert body.endswith(b"data: [DONE]\n\n")
    assert registry.in_flight == 0
