"""A second task reading a consumer that one task reads is refused, and the first
reads on undisturbed: whichever of ``result()``, ``async for`` and ``next_ready()``
each uses, in either order. No such sequence makes a wait return without waiting."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import tether

Read = Callable[[tether.Stream | tether.Batch], Awaitable[Any]]


async def _result(consumer: tether.Stream | tether.Batch) -> Any:
    return await consumer.result()


async def _iterate(consumer: tether.Stream | tether.Batch) -> Any:
    return [item async for item in consumer]


async def _next_ready(consumer: tether.Stream | tether.Batch) -> Any:
    items: list[Any] = []
    while (chunk := await consumer.next_ready()) is not None:
        items.extend(chunk)
    return items


READS: dict[str, Read] = {"result": _result, "iterate": _iterate, "next_ready": _next_ready}


def _expected(how: str, outputs: list[Any], *, batch: bool) -> Any:
    if how == "result":
        return [outputs[-1]] if batch else outputs[-1]
    return [(0, output) for output in outputs] if batch else outputs


async def _parked(task: asyncio.Task[Any]) -> None:
    """Let ``task`` run until it waits (a few turns of the loop, no timing)."""
    for _ in range(5):
        await asyncio.sleep(0)
    assert not task.done(), f"the first reader did not wait: {task!r}"


@pytest.mark.parametrize("second", list(READS))
@pytest.mark.parametrize("first", list(READS))
@pytest.mark.parametrize("batch", [False, True], ids=["stream", "batch"])
async def test_second_reader_is_refused_without_disturbing_the_first(
    registry: tether.Registry, first: str, second: str, batch: bool
) -> None:
    consumer: tether.Stream | tether.Batch = registry.open_batch(1) if batch else registry.open()
    rid = consumer.rids[0] if isinstance(consumer, tether.Batch) else consumer.rid
    loop = asyncio.get_running_loop()
    reader = loop.create_task(READS[first](consumer))
    await _parked(reader)
    with pytest.raises(tether.ConcurrentRead):
        await READS[second](consumer)
    # The refusal changed nothing: the first reader still waits, and it does wait
    # (a spinning wait would never let this task run again: the timeout proves it).
    async with asyncio.timeout(10):
        for _ in range(5):
            await asyncio.sleep(0)
    assert not reader.done()
    registry.deliver(rid, "one")
    registry.deliver(rid, "two", finished=True)
    async with asyncio.timeout(10):
        assert await reader == _expected(first, ["one", "two"], batch=batch)
    assert registry.in_flight == 0


@pytest.mark.parametrize("first", list(READS))
async def test_a_refused_reader_leaves_outputs_that_woke_the_first_to_the_first(
    registry: tether.Registry, first: str
) -> None:
    """Between its wake-up and its turn, the first reader still owns the stream."""
    stream = registry.open()
    reader = asyncio.get_running_loop().create_task(READS[first](stream))
    await _parked(reader)
    registry.deliver(stream.rid, "one")  # wakes the first; it has not run yet
    for read in READS.values():
        with pytest.raises(tether.ConcurrentRead):
            await read(stream)
    with pytest.raises(tether.ConcurrentRead):
        stream.ready()
    registry.deliver(stream.rid, "two", finished=True)
    async with asyncio.timeout(10):
        assert await reader == _expected(first, ["one", "two"], batch=False)


async def test_a_second_result_after_the_first_returned_gets_the_same_result(
    registry: tether.Registry,
) -> None:
    stream = registry.open()
    registry.deliver(stream.rid, "done", finished=True)
    assert await stream.result() == "done"
    assert await stream.result() == "done"


async def test_a_cancelled_result_leaves_its_outputs_to_the_next_reader(
    registry: tether.Registry,
) -> None:
    stream = registry.open()
    registry.deliver(stream.rid, "one")
    reader = asyncio.get_running_loop().create_task(stream.result())
    await _parked(reader)
    with pytest.raises(tether.ConcurrentRead):
        await stream.result()
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    assert registry.in_flight == 0  # cancelling the reading task aborts the request
    with pytest.raises(tether.Aborted):
        await stream.result()
