"""A producer's odd exception never raises back into the producer, and a result,
once there, stays readable: asked twice, or after the wait that asked was cancelled
(unless that cancel aborted the request in flight: an abort forgets unread outputs)."""

from __future__ import annotations

import asyncio
import operator
from typing import Any

import pytest

import tether

from .conftest import AbortLog


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


async def parked_in_result(stream: tether.Stream) -> asyncio.Task[object]:
    """A task waiting in ``stream.result()``, once it parked there."""
    parked = asyncio.Event()

    async def wait_for_result() -> object:
        parked.set()  # the task goes on, in this same step, to park in result()
        return await stream.result()

    reader = asyncio.create_task(wait_for_result())
    await parked.wait()
    return reader


async def test_a_result_cancelled_after_the_finish_leaves_the_output_readable() -> None:
    registry = tether.Registry()
    stream = registry.open()
    async with asyncio.timeout(10):
        reader = await parked_in_result(stream)
        registry.deliver(stream.rid, "answer", finished=True)
        reader.cancel()  # (a timeout that fires in the same turn as the finish)
        await asyncio.wait([reader])
        assert [output async for output in stream] == ["answer"]


@pytest.mark.parametrize("merge", [None, operator.add], ids=["last-wins", "merged"])
async def test_a_result_cancelled_in_flight_aborts_and_leaves_nothing_to_read(
    aborts: AbortLog, merge: Any
) -> None:
    """Cancelling the task waiting in ``result()`` of a request in flight aborts it,
    and an abort forgets the unread outputs: what ``result()`` folded does not wait
    again."""
    registry = tether.Registry(aborts, merge=merge)
    stream = registry.open()
    registry.deliver(stream.rid, "a")
    async with asyncio.timeout(10):
        reader = await parked_in_result(stream)
        registry.deliver(stream.rid, "b")  # folded into the result
        reader.cancel()
        await asyncio.wait([reader])
    assert reader.cancelled()
    assert stream.rid not in registry
    with pytest.raises(tether.Aborted) as raised:
        stream.ready()
    assert raised.value.reason is tether.AbortReason.CANCELLED
    assert aborts.rids == {stream.rid}
