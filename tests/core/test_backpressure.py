"""Backpressure: merge keeps one waiting output per request; without it, a clear error."""

from __future__ import annotations

import asyncio
import dataclasses
import operator
from typing import Any

import pytest

import tether

from .conftest import AbortLog


async def test_merge_under_a_slow_consumer_keeps_one_output_waiting_and_loses_nothing(
    aborts: AbortLog,
) -> None:
    registry = tether.Registry(aborts, merge=operator.add, max_pending=2)
    stream = registry.open()
    deltas = list(range(1, 10_001))
    received: list[int] = []
    for start in range(0, len(deltas), 1000):
        for delta in deltas[start : start + 1000]:
            registry.deliver(stream.rid, delta)
        ready = await stream.next_ready()
        assert ready is not None
        assert len(ready) == 1  # 1000 deltas waited as one folded output
        received.extend(ready)
    registry.deliver(stream.rid, 0, finished=True)
    received.extend(await stream.next_ready() or [])
    assert sum(received) == sum(deltas)
    assert not aborts.calls


async def test_merge_folds_batch_outputs_per_sub_request(aborts: AbortLog) -> None:
    registry = tether.Registry(aborts, merge=operator.add, max_pending=1)
    batch = registry.open_batch(2)
    first, second = batch.rids
    for _ in range(100):
        registry.deliver(first, "a")
        registry.deliver(second, "b")
    assert await batch.next_ready() == [(0, "a" * 100), (1, "b" * 100)]
    registry.deliver(first, "!", finished=True)
    registry.deliver(second, "?", finished=True)
    assert await batch.result() == ["!", "?"]


async def test_aborting_one_sub_request_keeps_its_siblings_outputs_in_their_own_places(
    aborts: AbortLog,
) -> None:
    # An abort drops the aborted sub-request's waiting outputs from the batch's
    # shared list; its siblings' later outputs must still fold into their own
    # entries and count against their own limit.
    registry = tether.Registry(aborts, merge=operator.add, max_pending=2)
    batch = registry.open_batch(3, keep_going=True)
    first, second, third = batch.rids
    registry.deliver(first, 1000)
    registry.deliver(second, 10)
    registry.deliver(third, 100)
    registry.abort(first)
    registry.deliver(second, 5)
    registry.deliver(third, 1, finished=True)
    registry.deliver(second, 0, finished=True)
    ready = await batch.next_ready()
    assert ready is not None
    outputs = [pair for pair in ready if not isinstance(pair[1], tether.Aborted)]
    assert outputs == [(1, 15), (2, 101)]
    assert [pair[0] for pair in ready if isinstance(pair[1], tether.Aborted)] == [0]
    assert aborts.rids == {first}


async def test_a_sub_request_at_its_limit_stays_at_it_when_a_sibling_is_aborted(
    aborts: AbortLog,
) -> None:
    registry = tether.Registry(aborts, max_pending=1)
    batch = registry.open_batch(2, keep_going=True)
    first, second = batch.rids
    registry.deliver(second, "waiting")
    registry.abort(first)
    registry.deliver(second, "one too many")
    with pytest.raises(tether.ConsumerTooSlow):  # (too slow ends a whole batch)
        await asyncio.wait_for(batch.result(), 10)


async def test_too_many_waiting_outputs_without_merge_raise_consumer_too_slow(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    registry = tether.Registry(aborts, max_pending=4)
    stream = registry.open()
    for output in range(4):
        assert registry.deliver(stream.rid, output)
    assert registry.deliver(stream.rid, 4)  # the fifth: the request ends, loudly
    assert registry.in_flight == 0
    with pytest.raises(tether.ConsumerTooSlow) as caught:
        await anext(stream)
    assert caught.value.reason is tether.AbortReason.CONSUMER_TOO_SLOW
    assert caught.value.max_pending == 4
    await aborts.wait_for(1)
    assert aborts.calls == {stream.rid: 1}
    assert registry.stats().aborted == {"consumer_too_slow": 1}
    assert registry.deliver(stream.rid, 5) is False


async def test_a_consumer_that_keeps_up_never_hits_max_pending(aborts: AbortLog) -> None:
    registry = tether.Registry(aborts, max_pending=2)
    stream = registry.open()
    for output in range(100):
        registry.deliver(stream.rid, output)
        assert await anext(stream) == output
    registry.deliver(stream.rid, 100, finished=True)
    assert [output async for output in stream] == [100]


async def test_too_slow_sub_request_aborts_its_whole_batch(aborts: AbortLog) -> None:
    registry = tether.Registry(aborts, max_pending=2)
    batch = registry.open_batch(3)
    slow = batch.rids[1]
    for output in range(3):
        registry.deliver(slow, output)
    with pytest.raises(tether.ConsumerTooSlow):
        await batch.result()
    assert registry.in_flight == 0
    await aborts.wait_for(3)
    assert aborts.calls == dict.fromkeys(batch.rids, 1)


async def test_result_folds_while_the_consumer_sleeps_without_hitting_max_pending(
    aborts: AbortLog,
) -> None:
    registry = tether.Registry(aborts, max_pending=1)
    stream = registry.open()
    started = asyncio.Event()

    async def collect() -> object:
        started.set()  # result() then parks before this task yields
        return await stream.result()

    waiting = asyncio.ensure_future(collect())
    async with asyncio.timeout(10):
        await started.wait()
    for output in range(50):
        registry.deliver(stream.rid, output)
    registry.deliver(stream.rid, 50, finished=True)
    async with asyncio.timeout(10):
        assert await waiting == 50


async def test_a_finished_request_whose_consumer_lags_ends_with_the_error_but_is_no_abort(
    aborts: AbortLog,
) -> None:
    registry = tether.Registry(aborts, max_pending=2)
    stream = registry.open()
    batch = registry.open_batch(2)
    for rid in (stream.rid, batch.rids[0]):
        registry.deliver(rid, 1)
        registry.deliver(rid, 2)
        assert registry.deliver(rid, 3, finished=True) is True  # the producer is done with it
    with pytest.raises(tether.ConsumerTooSlow):
        await stream.result()
    with pytest.raises(tether.ConsumerTooSlow):
        await batch.result()
    assert registry.in_flight == 0
    await aborts.wait_for(1)
    # Only the sibling that was still running hears of it; the finished ones never do.
    assert aborts.calls == {batch.rids[1]: 1}


MIB = 1024 * 1024


@pytest.mark.parametrize("merge", [None, operator.add], ids=["no-merge", "merge"])
async def test_large_outputs_for_a_consumer_that_never_reads_end_at_the_byte_budget(
    aborts: AbortLog, merge: Any
) -> None:
    registry = tether.Registry(aborts, merge=merge, max_pending_bytes=4 * MIB)
    stream = registry.open()
    delivered = 0
    while stream.rid in registry and delivered < 100:  # 1,024 outputs would be allowed by count
        registry.deliver(stream.rid, "x" * MIB)
        delivered += 1
    # The budget, not max_pending, ended it: caught before about twice the budget waited
    # (outputs are weighed at 2, 4, 8 ... waiting, each standing for those since).
    assert delivered <= 8
    with pytest.raises(tether.ConsumerTooSlow, match="max_pending_bytes") as caught:
        await stream.next_ready()
    assert caught.value.max_bytes == 4 * MIB
    await aborts.wait_for(1)
    assert aborts.calls == {stream.rid: 1}
    assert registry.stats().aborted == {"consumer_too_slow": 1}


async def test_large_outputs_for_a_batch_that_never_reads_end_at_the_byte_budget(
    aborts: AbortLog,
) -> None:
    registry = tether.Registry(aborts, max_pending_bytes=4 * MIB)
    batch = registry.open_batch(2)
    for _ in range(8):
        registry.deliver(batch.rids[0], {"text": "y" * MIB, "meta": {"n": 1}})
    with pytest.raises(tether.ConsumerTooSlow):
        await batch.result()
    assert registry.in_flight == 0


async def test_a_consumer_that_keeps_up_with_large_outputs_never_hits_the_byte_budget() -> None:
    registry = tether.Registry(max_pending_bytes=2 * MIB)
    stream = registry.open()
    for _ in range(50):
        registry.deliver(stream.rid, b"z" * MIB)
        assert await stream.next_ready() == [b"z" * MIB]
    registry.deliver(stream.rid, b"", finished=True)
    assert await stream.next_ready() == [b""]
    assert await stream.next_ready() is None


def test_approximate_size_sees_the_bytes_inside_an_output() -> None:
    output = {"text": "x" * 1000, "meta_info": {"id": "r-1", "tokens": [1, 2, 3]}}
    assert 1000 < tether.approximate_size(output) < 1200
    assert tether.approximate_size(b"abc") == 3 + 8  # the bytes, and a word
    assert tether.approximate_size(memoryview(b"abcd")) == 4 + 8
    assert 20 <= tether.approximate_size(["a" * 10, ("b" * 10,)]) < 64  # bytes, and a word each


def test_approximate_size_looks_inside_deep_outputs_and_objects_at_a_bounded_cost() -> None:
    @dataclasses.dataclass
    class Delta:
        text: str

    class Slotted:
        __slots__ = ("payload",)

        def __init__(self, payload: bytes) -> None:
            self.payload = payload

    deep = {"choices": [{"delta": {"tool_calls": [{"function": {"arguments": "x" * 10_000}}]}}]}
    assert tether.approximate_size(deep) >= 10_000
    assert tether.approximate_size(Delta("y" * 10_000)) >= 10_000
    assert tether.approximate_size(Slotted(b"z" * 10_000)) >= 10_000
    wide = ["w" * 100] * 100_000  # 10 MB in 100,000 values: looked at in part, extrapolated
    assert 5_000_000 < tether.approximate_size(wide) < 20_000_000
