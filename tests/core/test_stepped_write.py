"""A write driven from the producer's step (``tether.http.Stepped``) runs only in a task
of the handler's thread: a thread's hand-over, in a loop callback, never drives it,
unless the writer was told its chain needs no task (``callbacks=True``): then it writes
there too, and a chain that does need one fails that write (never retried)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from tether import _stepped
from tether._stepped import SUSPENDS_IN_A_ROW
from tether.http import Stepped


def _recording() -> tuple[Stepped, list[bytes]]:
    sent: list[bytes] = []

    async def write(chunk: bytes, last: bool) -> None:
        sent.append(chunk)

    return Stepped(write), sent


async def test_a_stepped_write_in_a_task_of_the_handlers_thread_is_written_at_once() -> None:
    stepped, sent = _recording()
    assert stepped.writable()
    assert stepped.write(b"x") is True
    assert sent == [b"x"]


async def _hand_overs(stepped: Stepped, count: int) -> list[object]:
    """What ``stepped.write`` answers, each call in a loop callback of its own."""
    loop = asyncio.get_running_loop()
    results: list[object] = []
    done = asyncio.Event()

    def hand_over() -> None:
        results.append(stepped.write(b"%d" % len(results)))
        if len(results) < count:
            loop.call_soon(hand_over)
        else:
            done.set()

    loop.call_soon(hand_over)
    async with asyncio.timeout(10):
        await done.wait()
    return results


async def test_a_hand_over_outside_any_task_is_declined_and_the_handler_writes_for_good() -> None:
    stepped, sent = _recording()
    results = await _hand_overs(stepped, SUSPENDS_IN_A_ROW)  # (no task: a thread's step)
    assert results == [False] * SUSPENDS_IN_A_ROW
    assert sent == []
    assert not stepped.writable()  # even in a task now: the handler writes for good
    assert stepped.write(b"y") is False
    assert sent == []


async def test_one_hand_over_outside_any_task_is_enough_to_settle_it() -> None:
    stepped, sent = _recording()
    done = asyncio.Event()
    declined: list[object] = []

    def hand_over() -> None:
        declined.append(stepped.write(b"x"))
        done.set()

    asyncio.get_running_loop().call_soon(hand_over)
    async with asyncio.timeout(10):
        await done.wait()
    assert declined == [False]
    assert stepped.write(b"y") is False  # the handler's own writes go its own way now
    assert sent == []


async def _awaits_a_cancelled_future(chunk: bytes, last: bool) -> None:
    """A send chain whose first step awaits a future already cancelled."""
    gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    gone.cancel()
    await gone


async def test_a_send_step_that_raises_cancelled_error_is_handed_to_the_write_loop() -> None:
    """A send chain that awaits a future already cancelled (a middleware's flow-control
    future, a finished task) raises ``CancelledError`` in its first step: the writing
    task meets it, as in its own write, never the producer's task."""
    stepped = Stepped(_awaits_a_cancelled_future)
    begun = stepped.write(b"x")
    assert begun is not True
    assert begun is not False
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
    with pytest.raises(asyncio.CancelledError):
        await begun  # type: ignore[misc]


async def test_a_send_step_in_a_cancelled_producers_step_lets_the_cancellation_go_on() -> None:
    """The other side: the producer's own task was cancelled during its step, and the
    send step raises ``CancelledError``: that is still the send chain's (a task's
    ``cancel()`` inside its own synchronous step only marks its next await), handed to
    the write loop; the producer's cancellation goes on at its next await."""
    stepped = Stepped(_awaits_a_cancelled_future)
    written: list[Any] = []

    async def producer() -> None:
        asyncio.current_task().cancel()  # type: ignore[union-attr]
        written.append(stepped.write(b"x"))

    async with asyncio.timeout(10):
        task = asyncio.create_task(producer())
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()
        [begun] = written
        assert begun is not True
        assert begun is not False
        with pytest.raises(asyncio.CancelledError):
            await begun  # (the write loop meets it)


async def test_told_so_a_hand_over_outside_any_task_writes_at_once() -> None:
    sent: list[bytes] = []

    async def write(chunk: bytes, last: bool) -> None:
        sent.append(chunk)

    stepped = Stepped(write, callbacks=True)
    count = 2 * SUSPENDS_IN_A_ROW
    assert await _hand_overs(stepped, count) == [True] * count
    assert sent == [b"%d" % n for n in range(count)]
    assert stepped.write(b"y") is True  # and in a task as well


async def test_told_so_a_send_that_needs_a_task_fails_its_write_in_a_hand_over() -> None:
    """The app said its chain needs no task, and one does: the write fails (its writing
    task meets the error and ends the response), nothing is retried."""
    sent: list[bytes] = []

    async def write(chunk: bytes, last: bool) -> None:
        async with asyncio.timeout(10):
            sent.append(chunk)
            await asyncio.sleep(0)

    stepped = Stepped(write, callbacks=True)
    (begun,) = await _hand_overs(stepped, 1)
    assert not isinstance(begun, bool)  # a begun write, for the writing task
    with pytest.raises(RuntimeError, match="inside a task"):
        await begun  # type: ignore[misc]
    assert sent == []


async def test_told_so_a_send_that_needs_a_task_is_named_to_the_operator_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The failure says its likely cause (``producer_writes='threads'`` with a wrapper
    that needs a task) once at WARNING; the next ones at DEBUG, never a flood."""
    monkeypatch.setattr(_stepped, "_said", False)

    async def write(chunk: bytes, last: bool) -> None:
        async with asyncio.timeout(10):
            await asyncio.sleep(0)

    caplog.set_level(logging.DEBUG, logger="tether")
    for begun in await _hand_overs(Stepped(write, callbacks=True), 1) + await _hand_overs(
        Stepped(write, callbacks=True), 1
    ):
        with pytest.raises(RuntimeError):
            await begun  # type: ignore[misc]
    said = [record for record in caplog.records if "producer_writes='threads'" in record.message]
    assert [record.levelno for record in said] == [logging.WARNING, logging.DEBUG]
