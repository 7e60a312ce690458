"""A producer's odd exception never raises back into the producer, and a result,
once there, stays readable: asked twice, or after the wait that asked was cancelled."""

from __future__ import annotations

import asyncio

import pytest

import tether


class _StatusNotReadable(Exception):
    """A cause whose ``status_code`` is a property that fails (say it reads a response
    that is not there): ``getattr(cause, "status_code", None)`` only absorbs
    ``AttributeError``."""

    @property
    def status_code(self) -> int:
        raise RuntimeError("no response to read a status from")


class _TextNotReadable(Exception):
    """A client-facing cause (4xx) whose ``__str__`` fails."""

    status_code = 400

    def __str__(self) -> str:
        raise ValueError("the message template lacks a field")


@pytest.mark.parametrize(
    "cause",
    [_StatusNotReadable(), _TextNotReadable()],
    ids=["status_code-raises", "str-raises"],
)
async def test_fail_never_raises_into_the_producer_whatever_the_cause(
    cause: Exception,
) -> None:
    registry = tether.Registry()
    stream = registry.open()
    assert registry.fail(stream.rid, cause) is True
    with pytest.raises(tether.ProducerError):
        async with asyncio.timeout(10):
            await stream.result()
    assert registry.in_flight == 0


async def test_deliver_never_raises_when_merge_raises_an_unprintable_error() -> None:
    def merge(older: object, newer: object) -> object:
        raise _TextNotReadable()

    registry = tether.Registry(merge=merge)
    stream = registry.open()
    other = registry.open()
    registry.deliver(stream.rid, 1)
    # one engine step: the first triple's merge raises, the second must still arrive
    registry.deliver_many([(stream.rid, 2, False), (other.rid, "done", True)])
    async with asyncio.timeout(10):
        assert await other.result() == "done"
    await stream.aclose()


async def test_result_called_twice_returns_the_same_result_both_times() -> None:
    registry = tether.Registry()
    stream = registry.open()
    registry.deliver(stream.rid, "answer", finished=True)
    async with asyncio.timeout(10):
        assert await stream.result() == "answer"
        assert await stream.result() == "answer"


async def test_batch_result_called_twice_returns_the_same_results_both_times() -> None:
    registry = tether.Registry()
    batch = registry.open_batch(2)
    for index, rid in enumerate(batch.rids):
        registry.deliver(rid, index, finished=True)
    async with asyncio.timeout(10):
        assert await batch.result() == [0, 1]
        assert await batch.result() == [0, 1]


async def test_a_result_cancelled_after_the_finish_leaves_the_output_readable() -> None:
    registry = tether.Registry()
    stream = registry.open()
    parked = asyncio.Event()

    async def wait_for_result() -> object:
        parked.set()  # the task goes on, in this same step, to park in result()
        return await stream.result()

    reader = asyncio.create_task(wait_for_result())
    async with asyncio.timeout(10):
        await parked.wait()
        registry.deliver(stream.rid, "answer", finished=True)
        reader.cancel()  # (a timeout that fires in the same turn as the finish)
        await asyncio.wait([reader])
        assert [output async for output in stream] == ["answer"]
