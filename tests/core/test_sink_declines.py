"""A producer-side write that the transport declines (its buffer filled) hands the
outputs back to the write loop untouched: each output is shaped and encoded once,
whichever of the two writes it."""

from __future__ import annotations

import asyncio
from collections import Counter

import tether
import tether.http


class _Transport:
    """A transport whose buffer fills once something was written to it directly."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.full = False
        self.asked = asyncio.Event()

    def writable(self) -> bool:
        self.asked.set()
        return not self.full

    def write(self, chunk: bytes) -> bool:
        if self.full:
            return False
        self.written.append(chunk)
        self.full = True  # the client reads slowly: the kernel's buffer is full now
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


async def test_an_output_the_transport_declines_is_shaped_once(registry: tether.Registry) -> None:
    shaped: Counter[str] = Counter()

    def transform(output: str) -> str:
        shaped[output] += 1
        return output.upper()

    stream = registry.open()
    exchange = tether.http.Exchange(stream, streaming=True, transform=transform)
    registry.deliver(stream.rid, "first")
    async with asyncio.timeout(10):
        head = await exchange.start()
        writer = _Writer()
        running = asyncio.ensure_future(exchange.run(writer, head.body))
        await writer.transport.asked.wait()  # parked, the sink set
        registry.deliver(stream.rid, "second")  # written by the sink: the buffer fills
        registry.deliver(stream.rid, "third")  # declined: the write loop writes it
        registry.deliver(stream.rid, "last", finished=True)
        await running
    body = b"".join([writer.framed[0], *writer.transport.written, *writer.framed[1:]])
    assert (
        body
        == b'data: "FIRST"\n\ndata: "SECOND"\n\ndata: "THIRD"\n\ndata: "LAST"\n\ndata: [DONE]\n\n'
    )
    assert shaped == dict.fromkeys(["first", "second", "third", "last"], 1)
    assert registry.in_flight == 0
