"""Batch: all-or-none registration, arrival order, results in order, failure rules, split."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import tether

from .conftest import AbortLog


async def test_batch_whose_sibling_finished_and_was_freed_before_any_await_delivers_all(
    registry: tether.Registry,
) -> None:
    batch = registry.open_batch(2)
    first, second = batch.rids
    registry.deliver(first, "first-done", finished=True)  # freed before anything awaited
    assert first not in registry
    registry.deliver(second, "second-partial")
    registry.deliver(second, "second-done", finished=True)
    assert [pair async for pair in batch] == [
        (0, "first-done"),
        (1, "second-partial"),
        (1, "second-done"),
    ]


async def test_batch_result_after_every_sub_request_was_freed_returns_all_in_order(
    registry: tether.Registry,
) -> None:
    batch = registry.open_batch(["b", "a", "c"])
    for rid in ("c", "a", "b"):
        registry.deliver(rid, rid.upper(), finished=True)
    assert registry.in_flight == 0
    assert await batch.result() == ["B", "A", "C"]
    assert batch.rids == ("b", "a", "c")
    assert len(batch) == 3


async def test_batch_iteration_yields_outputs_in_arrival_order(
    registry: tether.Registry,
) -> None:
    batch = registry.open_batch(3)
    arrivals = [(2, "x"), (0, "y"), (2, "z"), (1, "w")]
    received: list[tuple[int, str]] = []
    got_one = asyncio.Event()

    async def consume() -> None:
        async for pair in batch:
            received.append(pair)
            got_one.set()

    async with asyncio.timeout(10), asyncio.TaskGroup() as tasks:
        tasks.create_task(consume())
        registry.deliver(batch.rids[2], "x")
        got_one.clear()
        await got_one.wait()  # one arrival while the batch is parked, then several at once
        for index, output in arrivals[1:]:
            registry.deliver(batch.rids[index], output)
        for rid in batch.rids:
            registry.deliver(rid, "end", finished=True)
    assert received == [*arrivals, (0, "end"), (1, "end"), (2, "end")]


async def test_open_batch_registers_all_sub_requests_or_none(
    registry: tether.Registry,
) -> None:
    live = registry.open("taken")
    with pytest.raises(tether.DuplicateRequest):
        registry.open_batch(["free-1", "taken", "free-2"])
    assert registry.in_flight == 1
    assert "free-1" not in registry
    limited = tether.Registry(max_in_flight=2)
    one = limited.open()
    with pytest.raises(tether.Overloaded):
        limited.open_batch(2)
    assert limited.in_flight == 1
    await one.aclose()
    await live.aclose()


@pytest.mark.parametrize("rids", [3, ["a", "b", "c"]], ids=["count", "ids"])
async def test_batch_that_could_never_be_admitted_is_refused_as_too_large_not_overloaded(
    rids: int | list[str],
) -> None:
    limited = tether.Registry(max_in_flight=2)
    with pytest.raises(tether.BatchTooLarge) as caught:
        limited.open_batch(rids)  # on an idle registry: no retry could ever help
    assert isinstance(caught.value, ValueError)
    assert not isinstance(caught.value, tether.Overloaded)
    assert (caught.value.size, caught.value.limit) == (3, 2)
    assert limited.in_flight == 0
    assert limited.stats().opened == 0


@pytest.mark.parametrize(
    "rids",
    [pytest.param(0, id="zero"), pytest.param([], id="no-ids"), pytest.param(["a", "a"], id="dup")],
)
async def test_open_batch_rejects_empty_or_repeated_ids(
    registry: tether.Registry, rids: int | list[str]
) -> None:
    with pytest.raises(ValueError, match="batch"):
        registry.open_batch(rids)
    assert registry.in_flight == 0


async def test_failed_sub_request_aborts_the_others_by_default(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    batch = registry.open_batch(3)
    failing, finished, running = batch.rids
    registry.deliver(finished, "ok", finished=True)
    registry.fail(failing, RuntimeError("bad prompt"))
    with pytest.raises(tether.ProducerError) as caught:
        await batch.result()
    assert caught.value.rid == failing
    assert registry.in_flight == 0
    await aborts.wait_for(1)
    assert aborts.calls == {running: 1}  # not the failed one, not the finished one
    assert registry.stats().aborted == {"failed_sibling": 1}


async def test_server_abort_of_a_sub_request_aborts_the_batch_by_default(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    batch = registry.open_batch(2)
    registry.abort(batch.rids[0])
    with pytest.raises(tether.Aborted) as caught:
        await anext(batch)
    assert caught.value.reason is tether.AbortReason.SERVER
    assert registry.in_flight == 0
    assert aborts.calls == dict.fromkeys(batch.rids, 1)


async def test_keep_going_batch_puts_the_error_in_place_of_the_failed_result(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    batch = registry.open_batch(3, keep_going=True)
    failing, first, second = batch.rids
    cause = RuntimeError("bad prompt")
    registry.fail(failing, cause)
    registry.deliver(first, "one", finished=True)
    registry.deliver(second, "two", finished=True)
    results = await batch.result()
    assert isinstance(results[0], tether.ProducerError)
    assert results[0].__cause__ is cause
    assert results[1:] == ["one", "two"]
    assert not aborts.calls


async def test_keep_going_batch_iteration_yields_the_error_in_arrival_order(
    registry: tether.Registry,
) -> None:
    batch = registry.open_batch(2, keep_going=True)
    registry.deliver(batch.rids[1], "early")
    registry.fail(batch.rids[0], RuntimeError("bad"))
    registry.deliver(batch.rids[1], "late", finished=True)
    pairs = [pair async for pair in batch]
    assert [index for index, _ in pairs] == [1, 0, 1]
    assert isinstance(pairs[1][1], tether.ProducerError)
    assert [pairs[0][1], pairs[2][1]] == ["early", "late"]


async def test_batch_streams_split_each_sub_request_with_outputs_delivered_before(
    registry: tether.Registry,
) -> None:
    batch = registry.open_batch(2, keep_going=True)
    first, second = batch.rids
    registry.deliver(first, "a1")
    registry.fail(second, RuntimeError("bad"))
    one, two = batch.streams
    assert batch.streams == (one, two)  # taken once
    registry.deliver(first, "a2", finished=True)
    assert [output async for output in one] == ["a1", "a2"]
    with pytest.raises(tether.ProducerError):
        await anext(two)
    with pytest.raises(RuntimeError, match="streams"):
        await batch.result()


async def test_batch_sub_streams_cannot_be_read_once_the_batch_is_read(
    registry: tether.Registry,
) -> None:
    batch = registry.open_batch(1)
    registry.deliver(batch.rids[0], "x")
    assert await batch.next_ready() == [(0, "x")]
    (only,) = batch.streams  # taking them is only a look
    with pytest.raises(RuntimeError, match="already being read"):
        await anext(only)
    await batch.aclose()


async def test_batch_aclose_aborts_only_unfinished_sub_requests(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    batch = registry.open_batch(3)
    registry.deliver(batch.rids[0], "done", finished=True)
    async with batch:
        assert await anext(batch) == (0, "done")
    await batch.aclose()
    assert registry.in_flight == 0
    assert aborts.calls == dict.fromkeys(batch.rids[1:], 1)
    assert [pair async for pair in batch] == []


async def test_batch_next_ready_returns_every_ready_pair_then_none(
    registry: tether.Registry,
) -> None:
    batch = registry.open_batch(2)
    registry.deliver(batch.rids[1], "b")
    registry.deliver(batch.rids[0], "a", finished=True)
    assert await batch.next_ready() == [(1, "b"), (0, "a")]
    assert await batch.next_ready(timeout=0.01) == []
    registry.deliver(batch.rids[1], "c", finished=True)
    assert await batch.next_ready() == [(1, "c")]
    assert await batch.next_ready() is None


async def test_cancelling_the_task_reading_a_batch_aborts_the_batch(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    batch = registry.open_batch(2)
    started = asyncio.Event()

    async def collect() -> list[object]:
        started.set()  # result() then parks before this task yields
        return await batch.result()

    task = asyncio.ensure_future(collect())
    async with asyncio.timeout(10):
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert registry.in_flight == 0
    assert aborts.calls == dict.fromkeys(batch.rids, 1)


async def test_split_streams_keep_their_requests_when_the_batch_is_dropped(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    first, second = registry.open_batch(2).streams  # the Batch itself is garbage at once
    assert registry.in_flight == 2
    registry.deliver(first.rid, "x", finished=True)
    assert [output async for output in first] == ["x"]
    await second.aclose()
    assert aborts.calls == {second.rid: 1}


async def test_reading_the_streams_property_leaves_the_batch_readable_as_a_whole(
    registry: tether.Registry,
) -> None:
    batch = registry.open_batch(2)
    logged = [stream.rid for stream in batch.streams]  # say, to log the rids
    assert logged == list(batch.rids)
    for rid in batch.rids:
        registry.deliver(rid, rid, finished=True)
    assert await batch.result() == logged


@pytest.mark.parametrize(
    "ending",
    ["fail", "abort", "deadline"],
)
async def test_a_failed_batch_read_through_its_sub_streams_still_reports_the_failure(
    registry: tether.Registry, aborts: AbortLog, ending: str
) -> None:
    batch = registry.open_batch(3, timeout=0.05 if ending == "deadline" else None)
    finished, failing, _running = batch.rids
    registry.deliver(finished, "done", finished=True)
    registry.deliver(failing, "partial")
    if ending == "fail":
        registry.fail(failing, RuntimeError("bad prompt"))
    elif ending == "abort":
        registry.abort(failing)
    else:
        await aborts.wait_for(2)  # the deadline passed: both unfinished ones were aborted
    done, failed, aborted = batch.streams  # split only now, after the failure
    # The sibling that finished before the failure keeps its output, and ends cleanly.
    assert [output async for output in done] == ["done"]
    # The failing one: what it delivered before a failure (not before an abort), then its error.
    if ending == "fail":
        assert await anext(failed) == "partial"
    with pytest.raises(tether.TetherError):
        await anext(failed)
    # The sibling aborted because of it never ends as if it had finished.
    with pytest.raises(tether.TetherError):
        await anext(aborted)
    with pytest.raises(tether.TetherError):
        await anext(aborted)  # and again: an ending does not wear off
    await batch.aclose()
    assert registry.in_flight == 0


async def test_a_failed_batch_read_whole_yields_what_finished_before_then_raises(
    registry: tether.Registry,
) -> None:
    batch = registry.open_batch(2)
    registry.deliver(batch.rids[0], "done", finished=True)
    registry.fail(batch.rids[1], RuntimeError("bad"))
    assert await anext(batch) == (0, "done")
    with pytest.raises(tether.ProducerError):
        await anext(batch)


async def test_a_batch_read_apart_keeps_each_sub_requests_byte_budget(aborts: AbortLog) -> None:
    """What waited in the batch's shared list before one sub-stream was read still
    counts against its own sub-request's byte budget once each is its own mailbox."""
    # Each output weighs 1: at 2, 4, 8, 16 waiting, the budget sees 1, 3, 7, 15 bytes
    # behind the oldest.
    registry = tether.Registry(aborts, max_pending_bytes=12, sizeof=lambda output: 1)
    async with registry.open_batch(2) as batch:
        read, lagging = batch.streams
        for n in range(8):
            registry.deliver(lagging.rid, n)  # waits in the batch's list: 7 bytes, fits
        registry.deliver(read.rid, "first")
        async with asyncio.timeout(10):
            assert await read.next_ready() == ["first"]  # each sub-request its own mailbox now
        for n in range(8, 16):
            registry.deliver(lagging.rid, n)
        assert lagging.rid not in registry, "15 bytes wait behind the oldest under a budget of 12"
        with pytest.raises(tether.ConsumerTooSlow) as raised:
            lagging.ready()
        assert raised.value.max_bytes == 12
        assert read.rid in registry  # (a batch read apart: the slow one ends alone)
        await aborts.wait_for(1)
        assert aborts.rids == {lagging.rid}


async def test_a_cancelled_keep_going_batch_result_leaves_no_output_after_its_error() -> None:
    """A keep-going batch whose ``result()`` is cancelled after one sub-request failed:
    what that sub-request delivered before failing (folded into the result, readable
    again) is read before its error, never after it."""
    registry = tether.Registry()
    batch = registry.open_batch(2, keep_going=True)
    failing = batch.rids[0]
    parked = asyncio.Event()

    async def wait_for_result() -> object:
        parked.set()
        return await batch.result()

    async with asyncio.timeout(10):
        reader = asyncio.create_task(wait_for_result())
        await parked.wait()
        registry.deliver(failing, "a")  # folded into the result
        registry.fail(failing, RuntimeError("engine"))
        reader.cancel()
        await asyncio.wait([reader])
    pairs: list[tuple[int, Any]] = []

    async def read_all() -> None:
        async for pair in batch:
            pairs.append(pair)

    with pytest.raises(tether.Aborted):
        await read_all()
    of_failing = [output for index, output in pairs if index == 0]
    assert [type(output) for output in of_failing] == [str, tether.ProducerError], of_failing


def _refuses_bad(older: Any, newer: Any) -> Any:
    if newer == "bad":
        raise TypeError("cannot merge 'bad'")
    return older + newer


async def test_a_merge_that_raises_in_a_batch_results_fold_fails_that_request_and_loses_nothing(
    aborts: AbortLog,
) -> None:
    """``result()`` folds what was delivered but not read (here an output an ``async
    for`` buffered and a newer one): a ``merge`` that raises there fails that request
    (``ProducerError``), as it does in ``deliver()``, and ends it."""
    registry = tether.Registry(aborts, merge=_refuses_bad)
    batch = registry.open_batch(2)
    first, second = batch.rids
    registry.deliver(first, "a")
    registry.deliver(second, "b")
    async with asyncio.timeout(10):
        assert await anext(batch) == (0, "a")  # (1, "b") stays buffered, unread
        registry.deliver(second, "bad")  # waits apart from "b": nothing merges it yet
        with pytest.raises(tether.ProducerError):
            await batch.result()
    assert second not in registry
    await batch.aclose()
