"""A write loop cancelled (the server's shutdown) right after the producer's last output
still sends that output, before its farewell: the request finished, its client gets all
of it."""

from __future__ import annotations

import asyncio

import tether
import tether.http


class _Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.asked = asyncio.Event()

    def writable(self) -> bool:
        self.asked.set()
        return True

    def write(self, chunk: bytes) -> bool:
        self.written.append(chunk)
        return True


class _Writer:
    lost_when_cut = False

    def __init__(self) -> None:
        self.transport = _Transport()
        self.framed: list[bytes] = []

    async def start(self) -> None:
        return None

    async def write(self, chunk: bytes, last: bool) -> None:
        self.framed.append(chunk)

    async def answer(self, head: tether.http.Head) -> None:
        raise AssertionError("the response had started")

    def drop(self) -> None:
        raise AssertionError("nobody stalled")

    def direct(self) -> _Transport:
        return self.transport


async def test_the_last_output_goes_out_before_the_farewell_of_a_cancelled_write_loop(
    registry: tether.Registry,
) -> None:
    stream = registry.open()
    exchange = tether.http.Exchange(stream, streaming=True)
    registry.deliver(stream.rid, "first")
    async with asyncio.timeout(10):
        head = await exchange.start()
        writer = _Writer()
        running = asyncio.ensure_future(exchange.run(writer, head.body))
        await writer.transport.asked.wait()  # parked, the sink set
        registry.deliver(stream.rid, "second")
        registry.deliver(stream.rid, "last", finished=True)
        running.cancel()  # in the same step: the server's shutdown
        await asyncio.wait([running])
    body = b"".join([writer.framed[0], *writer.transport.written, *writer.framed[1:]])
    assert body.startswith(b'data: "first"\n\ndata: "second"\n\ndata: "last"\n\n'), body
    assert body.endswith(b"data: [DONE]\n\n")
    assert registry.in_flight == 0
