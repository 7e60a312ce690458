"""Calls handed to the loop from a producer thread run in the order they were made: in
a loop callback until a write declined there asks for a task, then in a task per
burst, which nothing (a failing call, a cancellation before its step) can cut short."""

from __future__ import annotations

import asyncio
import threading

import pytest

import tether
from tether._handover import HandOver, want_task
from tether.http import Stepped


class Calls:
    """Records each call's number and whether it ran in a task; ``done`` is set by the
    ``last``-th call."""

    def __init__(self, last: int) -> None:
        self.seen: list[tuple[int, bool]] = []
        self.last = last
        self.done = asyncio.Event()

    def __call__(self, number: int) -> None:
        self.seen.append((number, asyncio.current_task() is not None))
        if number == self.last:
            self.done.set()


async def _from_a_thread(hand: HandOver, calls: Calls, numbers: range) -> None:
    loop = asyncio.get_running_loop()

    def producer() -> None:
        for number in numbers:
            hand.send(loop, calls, number)

    await asyncio.to_thread(producer)


async def test_calls_run_in_order_in_a_loop_callback_while_nothing_asks_for_a_task() -> None:
    hand, calls = HandOver(), Calls(last=49)
    await _from_a_thread(hand, calls, range(50))
    async with asyncio.timeout(10):
        await calls.done.wait()
    assert calls.seen == [(number, False) for number in range(50)]
    assert not hand.in_task


async def test_after_a_write_asks_for_a_task_the_next_calls_run_in_one_in_order() -> None:
    hand, calls = HandOver(), Calls(last=49)
    asked: list[bool] = []
    loop = asyncio.get_running_loop()
    hand.send(loop, lambda: asked.append(want_task()))  # a write declined in the callback
    await _from_a_thread(hand, calls, range(50))
    async with asyncio.timeout(10):
        await calls.done.wait()
    assert asked == [True]
    assert hand.in_task
    assert calls.seen == [(number, True) for number in range(50)]


def test_outside_a_hand_over_nobody_is_asked_for_a_task() -> None:
    assert want_task() is False


async def test_a_burst_cancelled_before_its_step_leaves_its_calls_to_the_next_in_order() -> None:
    """Whoever cancels every task (a runner, a test harness) may cancel a burst before
    it ran: its calls run first in the next burst, none lost, none out of order."""
    hand, calls = HandOver(), Calls(last=3)
    hand.in_task = True
    loop = asyncio.get_running_loop()
    for number in range(3):
        hand.send(loop, calls, number)
    cancelled: list[asyncio.Task[object]] = []

    def cancel_the_burst() -> None:  # runs after the hand-overs arrived, before the step
        for task in asyncio.all_tasks(loop):
            if task.get_name() == "tether-handover" and task.cancel():
                cancelled.append(task)

    loop.call_soon(cancel_the_burst)
    hand.send(loop, calls, 3)
    async with asyncio.timeout(10):
        await calls.done.wait()
    assert calls.seen == [(number, True) for number in range(4)]
    if cancelled:  # (under an eager task factory each burst ran at once: nothing to cancel)
        assert cancelled[0].cancelled()


@pytest.mark.parametrize("in_task", [False, True])
async def test_a_call_that_raises_is_reported_and_the_calls_after_it_still_run(
    in_task: bool,
) -> None:
    hand, calls = HandOver(), Calls(last=1)
    hand.in_task = in_task
    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _, context: reported.append(context))

    def fails() -> None:
        raise ValueError("engine bug")

    hand.send(loop, calls, 0)
    hand.send(loop, fails)
    hand.send(loop, calls, 1)
    async with asyncio.timeout(10):
        await calls.done.wait()
    assert [number for number, _ in calls.seen] == [0, 1]
    assert len(reported) == 1
    assert isinstance(reported[0]["exception"], ValueError)


async def test_a_stepped_write_declined_in_a_hand_over_is_not_settled_for_good() -> None:
    """Declined in the callback, the writer writes the registry's next hand-overs,
    which run in a task: the first step of a thread is the only one its handler writes."""
    sent: list[bytes] = []

    async def write(chunk: bytes, last: bool) -> None:
        sent.append(chunk)

    stepped, hand = Stepped(write), HandOver()
    results: list[object] = []
    loop = asyncio.get_running_loop()
    done = asyncio.Event()

    def offer(chunk: bytes) -> None:
        results.append(stepped.write(chunk))
        if chunk == b"second":
            done.set()

    hand.send(loop, offer, b"first")
    hand.send(loop, offer, b"second")
    async with asyncio.timeout(10):
        await done.wait()
    assert results == [False, True]
    assert sent == [b"second"]


async def test_outputs_and_then_a_failure_from_a_thread_reach_the_reader_in_that_order(
    registry: tether.Registry,
) -> None:
    """Whatever runs a burst, a failure handed over after outputs ends the request
    only once they are in: the reader gets them, then the error."""
    streams = [registry.open() for _ in range(4)]

    def engine() -> None:
        for step in range(20):
            registry.deliver_many_threadsafe([(stream.rid, step, False) for stream in streams])
        for stream in streams:
            registry.fail_threadsafe(stream.rid, RuntimeError("oom"))

    worker = threading.Thread(target=engine)
    worker.start()
    for stream in streams:
        async with asyncio.timeout(10):
            received, error = await _read_until_it_ends(stream)
        assert received == list(range(20))
        assert isinstance(error, tether.ProducerError)
    await asyncio.to_thread(worker.join)


async def _read_until_it_ends(stream: tether.Stream) -> tuple[list[object], Exception | None]:
    received: list[object] = []
    try:
        async for output in stream:
            received.append(output)
    except tether.TetherError as exc:
        return received, exc
    return received, None
