"""Stream: eager capture, order, closing, cancellation and the dropped-stream path."""

from __future__ import annotations

import asyncio
import gc
import operator
import warnings

import pytest

import tether

from .conftest import AbortLog


async def test_stream_built_before_finish_delivers_every_output(
    registry: tether.Registry,
) -> None:
    stream = registry.open()
    for output in ("a", "b"):
        registry.deliver(stream.rid, output)
    registry.deliver(stream.rid, "c", finished=True)
    assert registry.in_flight == 0  # the producer freed the entry before any read
    assert [output async for output in stream] == ["a", "b", "c"]


async def test_stream_result_after_the_producer_freed_the_rid_returns_the_final_output(
    registry: tether.Registry,
) -> None:
    stream = registry.open()
    registry.deliver(stream.rid, "partial")
    registry.deliver(stream.rid, "final", finished=True)
    assert stream.rid not in registry
    assert await stream.result() == "final"


async def test_outputs_reach_a_waiting_consumer_in_delivery_order_exactly_once(
    registry: tether.Registry,
) -> None:
    stream = registry.open()
    received: list[int] = []
    got_one = asyncio.Event()

    async def consume() -> None:
        async for output in stream:
            received.append(output)
            got_one.set()

    async with asyncio.timeout(10), asyncio.TaskGroup() as tasks:
        tasks.create_task(consume())
        for step in range(20):
            # alternate: sometimes the consumer is parked, sometimes several wait
            for output in range(step * 3, step * 3 + step % 3 + 1):
                registry.deliver(stream.rid, output)
            got_one.clear()
            await got_one.wait()
        registry.deliver(stream.rid, -1, finished=True)
    expected = [o for step in range(20) for o in range(step * 3, step * 3 + step % 3 + 1)]
    assert received == [*expected, -1]


async def test_next_ready_returns_every_ready_output_in_one_list(
    registry: tether.Registry,
) -> None:
    stream = registry.open()
    for output in range(3):
        registry.deliver(stream.rid, output)
    assert await stream.next_ready() == [0, 1, 2]
    assert await stream.next_ready(timeout=0.01) == []  # idle: nothing within the interval
    registry.deliver(stream.rid, 3, finished=True)
    assert await stream.next_ready() == [3]
    assert await stream.next_ready() is None


async def test_next_ready_after_a_partial_iteration_returns_the_rest_first(
    registry: tether.Registry,
) -> None:
    stream = registry.open()
    for output in range(3):
        registry.deliver(stream.rid, output)
    assert await anext(stream) == 0
    registry.deliver(stream.rid, 3, finished=True)
    assert await stream.next_ready() == [1, 2, 3]
    assert await stream.next_ready() is None


async def test_result_without_merge_is_the_last_output(registry: tether.Registry) -> None:
    stream = registry.open()
    waiting = asyncio.ensure_future(stream.result())
    for output in ("x", "y"):
        registry.deliver(stream.rid, output)
    registry.deliver(stream.rid, "z", finished=True)
    async with asyncio.timeout(10):
        assert await waiting == "z"


async def test_result_with_merge_folds_every_delta(aborts: AbortLog) -> None:
    registry = tether.Registry(aborts, merge=operator.add)
    stream = registry.open()
    registry.deliver(stream.rid, "He")
    waiting = asyncio.ensure_future(stream.result())
    registry.deliver(stream.rid, "ll")
    registry.deliver(stream.rid, "o", finished=True)
    async with asyncio.timeout(10):
        assert await waiting == "Hello"


async def test_result_of_a_request_finished_without_output_is_none(
    registry: tether.Registry,
) -> None:
    stream = registry.open()
    registry.deliver(stream.rid, None, finished=True)
    assert await stream.result() is None


async def test_producer_failure_reaches_the_consumer_after_earlier_outputs(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    stream = registry.open()
    registry.deliver(stream.rid, 1)
    cause = RuntimeError("engine fell over")
    assert registry.fail(stream.rid, cause)
    assert await anext(stream) == 1
    with pytest.raises(tether.ProducerError) as caught:
        await anext(stream)
    assert caught.value.__cause__ is cause
    assert caught.value.rid == stream.rid
    assert registry.in_flight == 0
    assert not aborts.calls  # the producer knows: no on_abort


async def test_aclose_frees_an_unfinished_rid_and_calls_on_abort_once(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    stream = registry.open()
    await stream.aclose()
    await stream.aclose()
    stream.cancel()
    assert registry.in_flight == 0
    assert aborts.calls == {stream.rid: 1}
    assert [output async for output in stream] == []


async def test_aclose_after_finish_does_not_call_on_abort(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    stream = registry.open()
    registry.deliver(stream.rid, 1, finished=True)
    await stream.aclose()
    assert not aborts.calls
    assert registry.stats().aborted_total == 0


async def test_async_with_closes_an_unfinished_stream(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    async with registry.open() as stream:
        registry.deliver(stream.rid, 1)
        assert await anext(stream) == 1
    assert registry.in_flight == 0
    assert aborts.calls == {stream.rid: 1}


async def test_cancel_wakes_the_waiting_consumer_with_aborted(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    stream = registry.open()
    waiting = asyncio.ensure_future(anext(stream))
    registry.deliver(stream.rid, "first")
    assert await waiting == "first"
    waiting = asyncio.ensure_future(anext(stream))
    assert stream.cancel(tether.AbortReason.CLIENT_DISCONNECTED)
    with pytest.raises(tether.Aborted) as caught:
        async with asyncio.timeout(10):
            await waiting
    assert caught.value.reason is tether.AbortReason.CLIENT_DISCONNECTED
    assert aborts.calls == {stream.rid: 1}
    assert not stream.cancel()  # nothing left in flight


async def test_cancelling_the_consuming_task_aborts_the_request(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    stream = registry.open()
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in stream:
            first.set()  # the loop then parks in __anext__ before this task yields

    task = asyncio.ensure_future(consume())
    registry.deliver(stream.rid, "first")
    async with asyncio.timeout(10):
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert registry.in_flight == 0
    assert aborts.calls == {stream.rid: 1}
    assert registry.stats().aborted == {"cancelled": 1}


async def test_dropped_stream_frees_its_rid_aborts_and_warns(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    stream = registry.open()
    rid = stream.rid
    with pytest.warns(ResourceWarning, match="dropped without being closed"):
        del stream  # the last reference: reference counting frees it here
    assert registry.in_flight == 0
    await aborts.wait_for(1)
    assert aborts.calls == {rid: 1}


async def test_dropped_finished_stream_does_not_warn(registry: tether.Registry) -> None:
    stream = registry.open()
    registry.deliver(stream.rid, 1, finished=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del stream
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


def test_stream_dropped_after_its_loop_closed_is_freed_without_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    unraisable: list[object] = []
    monkeypatch.setattr("sys.unraisablehook", unraisable.append)
    registry = tether.Registry(AbortLog())

    async def open_and_leave() -> tether.Stream:
        return registry.open()

    stream = asyncio.run(open_and_leave())
    with pytest.warns(ResourceWarning):
        del stream
    assert registry.in_flight == 0
    assert registry.stats().aborted == {"cancelled": 1}
    assert unraisable == []
