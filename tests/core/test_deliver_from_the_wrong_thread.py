"""``deliver()`` called outside the registry's loop is refused, before anything changes.

A producer thread that calls ``deliver()`` instead of ``deliver_threadsafe()`` used to
change the state behind the loop's back: the consumer was woken late (at the loop's
next unrelated wake-up) or, under ``-X dev``, never.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

import tether

BOUND = 10.0


def in_a_thread(call: Any) -> BaseException | None:
    """Run ``call()`` in a new thread; what it raised, if anything."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # handed to the test, which judges it
            raised.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(BOUND)
    assert not thread.is_alive()
    return raised[0] if raised else None


async def test_deliver_from_another_thread_raises_and_changes_nothing() -> None:
    registry = tether.Registry()
    stream = registry.open()

    raised = in_a_thread(lambda: registry.deliver(stream.rid, "out", finished=True))

    assert isinstance(raised, RuntimeError)
    assert stream.rid in str(raised)
    assert "deliver_threadsafe" in str(raised)
    assert stream.rid in registry
    assert registry.stats().finished == 0
    # The right way from a thread still works, and delivers the output.
    assert (
        in_a_thread(lambda: registry.deliver_threadsafe(stream.rid, "out", finished=True)) is None
    )
    async with asyncio.timeout(BOUND):
        assert await stream.result() == "out"


async def test_deliver_from_another_loop_raises() -> None:
    registry = tether.Registry()
    stream = registry.open()

    async def deliver_there() -> None:
        registry.deliver(stream.rid, "out")

    raised = in_a_thread(lambda: asyncio.run(deliver_there()))

    assert isinstance(raised, RuntimeError)
    await stream.aclose()


async def test_deliver_on_the_registrys_loop_is_not_refused() -> None:
    registry = tether.Registry()
    stream = registry.open()
    assert registry.deliver(stream.rid, "a")
    assert registry.deliver(stream.rid, "b", finished=True)
    async with asyncio.timeout(BOUND):
        assert [output async for output in stream] == ["a", "b"]


def test_late_outputs_from_another_thread_are_still_only_counted() -> None:
    registry = tether.Registry()  # nothing open: a late output has no state to protect
    assert in_a_thread(lambda: registry.deliver("gone", "out")) is None
    assert registry.stats().late_outputs == 1


@pytest.mark.parametrize("finished", [False, True])
async def test_a_batch_sub_request_from_another_thread_is_refused(finished: bool) -> None:
    registry = tether.Registry()
    batch = registry.open_batch(2)
    raised = in_a_thread(lambda: registry.deliver(batch.rids[0], "out", finished=finished))
    assert isinstance(raised, RuntimeError)
    await batch.aclose()


async def test_aclose_from_another_thread_is_refused_without_closing_the_stream() -> None:
    registry = tether.Registry()
    stream = registry.open()
    registry.deliver(stream.rid, "first")
    registry.deliver(stream.rid, "second")
    assert await anext(stream) == "first"

    raised = in_a_thread(lambda: asyncio.run(stream.aclose()))

    assert isinstance(raised, tether.WrongLoop)
    # Refused before anything changed: the stream reads on, nothing is lost.
    assert not stream.closed
    registry.deliver(stream.rid, "third", finished=True)
    async with asyncio.timeout(BOUND):
        assert [output async for output in stream] == ["second", "third"]
    assert registry.in_flight == 0


async def test_ready_from_another_thread_is_refused_and_takes_nothing() -> None:
    registry = tether.Registry()
    stream = registry.open()
    registry.deliver(stream.rid, "first")

    raised = in_a_thread(stream.ready)

    assert isinstance(raised, tether.WrongLoop)
    registry.deliver(stream.rid, "second", finished=True)
    async with asyncio.timeout(BOUND):
        assert [output async for output in stream] == ["first", "second"]
