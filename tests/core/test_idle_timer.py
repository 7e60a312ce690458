"""Timed waits (``next_ready(timeout=...)``): one idle timer per consumer, not one per output."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import tether


class _CountingTimers:
    """Counts the idle timers of consumers the running loop arms while installed."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.armed = 0
        self._loop = loop
        self._call_at = loop.call_at

    def call_at(self, when: float, callback: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(callback, "__name__", "") == "_fired":  # IdleDeadline's timer
            self.armed += 1
        return self._call_at(when, callback, *args, **kwargs)


async def test_timed_reads_of_a_busy_stream_arm_one_idle_timer_not_one_per_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    registry = tether.Registry()
    stream = registry.open()
    loop = asyncio.get_running_loop()
    timers = _CountingTimers(loop)
    monkeypatch.setattr(loop, "call_at", timers.call_at)

    async def produce() -> None:
        for n in range(200):
            await asyncio.sleep(0)  # one output per loop turn, so the reader waits each time
            registry.deliver(stream.rid, n, finished=n == 199)

    producer = asyncio.create_task(produce())
    received: list[int] = []
    async with asyncio.timeout(10):
        while (items := await stream.next_ready(timeout=30)) is not None:
            received.extend(items)
        await producer
    assert received == list(range(200))
    assert timers.armed == 1
    assert stream._idle is not None
    assert not stream._idle.armed  # stopped at the end, so nothing keeps the stream alive


async def test_idle_timeout_counts_from_the_current_wait_not_the_first() -> None:
    registry = tether.Registry()
    stream = registry.open()
    loop = asyncio.get_running_loop()
    timeout = 0.2
    async with asyncio.timeout(10):
        # The first wait arms the timer; an output ends it early.
        loop.call_soon(registry.deliver, stream.rid, "first")
        assert await stream.next_ready(timeout=timeout) == ["first"]
        # Start the second wait later than the first one's deadline would allow.
        started = loop.time()
        assert await stream.next_ready(timeout=timeout) == []
        waited = loop.time() - started
    assert waited >= timeout - 0.01
    await stream.aclose()


async def test_aclose_stops_the_idle_timer() -> None:
    registry = tether.Registry()
    stream = registry.open()
    reader = asyncio.create_task(stream.next_ready(timeout=30))
    async with asyncio.timeout(10):
        await asyncio.sleep(0)  # one loop turn: the reader starts its timed wait
        assert stream._idle is not None
        assert stream._idle.armed
        await stream.aclose()
        assert await reader is None
    assert not stream._idle.armed


async def test_a_short_timed_wait_after_a_longer_one_returns_on_its_own_deadline() -> None:
    registry = tether.Registry()
    stream = registry.open()
    loop = asyncio.get_running_loop()
    long_wait = asyncio.ensure_future(stream.next_ready(timeout=30))
    await asyncio.sleep(0)  # the long wait parks and arms the idle timer (a yield)
    registry.deliver(stream.rid, "x")
    assert await long_wait == ["x"]
    started = loop.time()
    async with asyncio.timeout(10):
        assert await stream.next_ready(timeout=0.05) == []
    assert loop.time() - started < 5  # its own 0.05 s, not what is left of the 30 s
    await stream.aclose()
