"""An adapter's writer with a direct write (aiohttp's transport write), for driving an
``Exchange`` by hand: what the producer's step writes goes to ``sink``, what the write
loop writes to ``framed``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import tether
import tether.http


def sse_values(data: bytes) -> list[object]:
    """The values of the ``data:`` frames in ``data``, ``"[DONE]"`` for the end."""
    frames = [frame for frame in data.split(b"\n\n") if frame.startswith(b"data: ")]
    return [
        "[DONE]" if frame == b"data: [DONE]" else json.loads(frame.removeprefix(b"data: "))
        for frame in frames
    ]


class DirectTransport:
    """A write that never waits, recorded. ``room``: how many direct writes it takes
    before its buffer is full and it declines the rest (None: it never fills)."""

    def __init__(self, room: int | None = None) -> None:
        self.written: list[bytes] = []
        self.room = room
        self.asked = asyncio.Event()  # the write loop asked whether it may park

    def writable(self) -> bool:
        self.asked.set()
        return self.room != 0

    def write(self, chunk: bytes) -> bool:
        if self.room == 0:
            return False
        self.written.append(chunk)
        if self.room is not None:
            self.room -= 1
        return True

    def values(self) -> list[object]:
        return sse_values(b"".join(self.written))


class DirectWriter:
    lost_when_cut = False

    def __init__(self, sink: DirectTransport | None = None) -> None:
        self.sink = DirectTransport() if sink is None else sink
        self.framed: list[tuple[bytes, bool]] = []

    async def start(self) -> None:
        return None

    async def write(self, chunk: bytes, last: bool) -> None:
        self.framed.append((chunk, last))

    async def answer(self, head: tether.http.Head) -> None:
        raise AssertionError("the response had started")

    def drop(self) -> None:
        raise AssertionError("nobody stalled")

    def direct(self) -> DirectTransport:
        return self.sink

    def body(self) -> bytes:
        """What the client got: the loop's first write, the direct writes, the rest."""
        chunks = [chunk for chunk, _ in self.framed]
        return b"".join([chunks[0], *self.sink.written, *chunks[1:]])


async def parked(
    exchange: tether.http.Exchange, first: bytes, sink: DirectTransport | None = None
) -> tuple[DirectWriter, asyncio.Task[None]]:
    """Run ``exchange`` until its write loop parks with the stream's sink set."""
    writer = DirectWriter(sink)
    task = asyncio.ensure_future(exchange.run(writer, first))
    await writer.sink.asked.wait()
    return writer, task


async def started_and_parked(
    registry: tether.Registry, sink: DirectTransport | None = None, **options: Any
) -> tuple[tether.Stream, tether.http.Exchange, DirectWriter, asyncio.Task[None]]:
    """A new request's streaming ``Exchange`` (with ``options``), started by its first
    output ``"first"``, run until its write loop parks with the sink set."""
    stream = registry.open()
    exchange = tether.http.Exchange(stream, streaming=True, **options)
    registry.deliver(stream.rid, "first")
    head = await exchange.start()
    writer, running = await parked(exchange, head.body, sink)
    return stream, exchange, writer, running
