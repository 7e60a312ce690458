"""A producer thread's hand-overs keep their order against the thread's own
``call_soon_threadsafe``: a thread that delivers a request's end and then tells the
loop so (a step-taken handshake, a done signal) finds the end in when the loop hears
it, even for a response whose writes are driven from the producer's side."""

from __future__ import annotations

import asyncio
import threading

import tether
from tether.http import Stepped


async def test_a_thread_s_deliveries_are_in_before_a_callback_it_hands_the_loop_after_them(
    registry: tether.Registry,
) -> None:
    loop = asyncio.get_running_loop()
    first, second = registry.open(), registry.open()

    async def write(chunk: bytes, last: bool) -> None:
        pass

    stepped = Stepped(write)  # a producer-written response (Starlette, producer_writes)
    assert first.set_sink(lambda outputs: stepped.write(b"") is True)
    in_flight_when_told: list[int] = []
    told = asyncio.Event()

    def tell() -> None:
        in_flight_when_told.append(registry.in_flight)
        told.set()

    def engine() -> None:
        registry.deliver_threadsafe(first.rid, "a")
        registry.deliver_threadsafe(second.rid, "end", finished=True)
        loop.call_soon_threadsafe(tell)

    worker = threading.Thread(target=engine)
    worker.start()
    worker.join()  # (on the loop: every hand-over is queued before the loop runs one)
    async with asyncio.timeout(10):
        await told.wait()
    assert in_flight_when_told == [1]  # the second request had ended
    await first.aclose()
