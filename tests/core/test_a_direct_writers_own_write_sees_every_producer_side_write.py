"""An adapter's direct writer is reached through its ``write()``: the producer-side write
of each event (the exchange's sink) goes through it, as the write loop's writes do.

An adapter built on ``tether.http.Stepped`` that adds to its ``write()`` (counts the
bytes for an access log, as aiohttp's own byte count misses direct writes; traces it)
by subclassing it, or a writer that wraps another and delegates the rest to it, must
see every byte it is asked to send. ``write_checked()`` is an optimisation found on
the object: one inherited, or reached through delegation, is not the writer's own
``write()`` and must not silently bypass it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

import tether
import tether.http
from tether.http import Stepped

Send = Callable[[bytes, bool], Any]


class CountingStepped(Stepped):
    """A Stepped whose write() counts what it is asked to send (an access log's %b)."""

    def __init__(self, send: Send, asked: asyncio.Event) -> None:
        super().__init__(send)
        self.counted: list[bytes] = []
        self.asked = asked

    def writable(self) -> bool:
        self.asked.set()
        return super().writable()

    def write(self, chunk: bytes) -> Any:
        written = super().write(chunk)
        if written is not False:
            self.counted.append(chunk)
        return written


class CountingWrapper:
    """A direct writer wrapping another: write() counts, the rest is the wrapped one's."""

    def __init__(self, send: Send, asked: asyncio.Event) -> None:
        self._inner = Stepped(send)
        self.counted: list[bytes] = []
        self.asked = asked

    def writable(self) -> bool:
        self.asked.set()
        return self._inner.writable()

    def write(self, chunk: bytes) -> Any:
        written = self._inner.write(chunk)
        if written is not False:
            self.counted.append(chunk)
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class Writer:
    """An adapter's Writer whose direct() is ``make(send, asked)``; ``sent``: every chunk
    the direct writer sent (what reached the transport that way)."""

    lost_when_cut = False

    def __init__(self, make: Callable[[Send, asyncio.Event], Any]) -> None:
        self.sent: list[bytes] = []
        self.framed: list[bytes] = []
        self.asked = asyncio.Event()  # the write loop asked whether it may park
        self._make = make
        self.made: Any = None

    async def start(self) -> None:
        return None

    async def write(self, chunk: bytes, last: bool) -> None:
        self.framed.append(chunk)

    async def answer(self, head: tether.http.Head) -> None:
        raise AssertionError("the response had started")

    def drop(self) -> None:
        raise AssertionError("nobody stalled")

    def direct(self) -> Any:
        async def send(chunk: bytes, last: bool) -> None:
            self.sent.append(chunk)

        self.made = self._make(send, self.asked)
        return self.made


@pytest.mark.parametrize("make", [CountingStepped, CountingWrapper], ids=["subclass", "wrapper"])
async def test_every_direct_write_goes_through_the_writers_own_write(make: Any) -> None:
    registry = tether.Registry()
    stream = registry.open()
    exchange = tether.http.Exchange(stream, streaming=True)
    registry.deliver(stream.rid, "first")
    head = await exchange.start()
    writer = Writer(make)
    running = asyncio.ensure_future(exchange.run(writer, head.body))
    async with asyncio.timeout(10):
        await writer.asked.wait()  # (parked: the sink is set)
        for n in range(5):
            registry.deliver(stream.rid, {"n": n})
        registry.deliver(stream.rid, {"n": 5}, finished=True)
        await running
    assert len(writer.sent) >= 5, "the direct writer was not exercised by the producer's step"
    assert writer.made.counted == writer.sent
