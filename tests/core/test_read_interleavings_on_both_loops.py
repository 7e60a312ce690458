"""Exactly once, in order, on_abort exactly once, counters that add up: a reader
iterating a stream (``async for``) against a producer, on asyncio's loop and on uvloop,
with and without ``merge`` and a ``max_pending`` bound, under any interleaving of
deliveries (``deliver``, ``deliver_many``, from another thread), the end, a failure, a
server abort, the reader's cancellation (waiting, or woken but not yet resumed),
``aclose()`` and a second reader, which is refused and changes nothing."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tether

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("deliver"), st.integers(1, 3)),
        st.tuples(st.just("deliver_many"), st.integers(1, 4)),
        st.tuples(st.just("threadsafe"), st.integers(1, 3)),
        st.tuples(st.just("turn"), st.integers(0, 3)),
        st.tuples(st.just("second_reader"), st.just(0)),
        st.tuples(st.just("cancel_reader"), st.just(0)),
        st.tuples(st.just("finish"), st.just(0)),
        st.tuples(st.just("fail"), st.just(0)),
        st.tuples(st.just("abort"), st.just(0)),
        st.tuples(st.just("aclose"), st.just(0)),
        st.tuples(st.just("restart_reader"), st.just(0)),
    ),
    max_size=25,
)


def _merge(older: Any, newer: Any) -> Any:
    return older + newer


async def _scenario(ops: list[tuple[str, int]], merge: bool, max_pending: int) -> None:
    aborts: list[str] = []
    handled: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: handled.append(context))
    registry = tether.Registry(
        aborts.append, max_pending=max_pending, merge=_merge if merge else None
    )
    stream = registry.open()
    rid = stream.rid
    delivered: list[int] = []  # what the producer handed over, in order
    read: list[tuple[int, ...]] = []  # each read output, as the numbers it stands for
    counter = iter(range(1, 10_000))
    ended_by: list[str] = []

    def next_output() -> tuple[int, ...]:
        number = next(counter)
        delivered.append(number)
        return (number,)

    async def reader() -> str:
        try:
            async for output in stream:
                read.append(output)
        except tether.TetherError as exc:
            return type(exc).__name__
        return "end"

    def check_counters() -> None:
        stats = registry.stats()
        assert stats.opened == (
            stats.finished + stats.failed + sum(stats.aborted.values()) + stats.in_flight
        )

    task: asyncio.Task[str] | None = loop.create_task(reader())
    for op, arg in ops:
        live = rid in registry
        if op == "deliver" and live:
            for _ in range(arg):
                registry.deliver(rid, next_output())
        elif op == "deliver_many" and live:
            registry.deliver_many([(rid, next_output(), False) for _ in range(arg)])
        elif op == "threadsafe" and live:
            outputs = [next_output() for _ in range(arg)]
            done = asyncio.Event()

            def produce(
                outputs: list[tuple[int, ...]] = outputs, done: asyncio.Event = done
            ) -> None:
                for output in outputs:
                    registry.deliver_threadsafe(rid, output)
                loop.call_soon_threadsafe(done.set)

            threading.Thread(target=produce).start()
            async with asyncio.timeout(10):
                await done.wait()
        elif op == "turn":
            for _ in range(arg):
                await asyncio.sleep(0)
        elif op == "second_reader":
            for _ in range(3):  # the reader parks first (a read nobody else makes waits)
                await asyncio.sleep(0)
            if task is not None and not task.done():
                with pytest.raises((tether.ConcurrentRead, StopAsyncIteration, tether.TetherError)):
                    await anext(stream)
        elif op == "cancel_reader" and task is not None:
            task.cancel()
            try:
                outcome = await task
            except asyncio.CancelledError:
                outcome = "cancelled"
            if outcome == "cancelled" and live:
                ended_by.append("cancelled")
            task = None
        elif op == "restart_reader" and (task is None or task.done()):
            task = loop.create_task(reader())
        elif op == "finish" and live:
            registry.deliver(rid, next_output(), finished=True)
        elif op == "fail" and live:
            registry.fail(rid, RuntimeError("boom"))
        elif op == "abort" and live:
            registry.abort(rid)
        elif op == "aclose":
            await stream.aclose()
            ended_by.append("aclose")
        check_counters()
    if rid in registry:
        registry.deliver(rid, next_output(), finished=True)
    if task is None or task.done():
        task = loop.create_task(reader())
    async with asyncio.timeout(10):
        await task
        for _ in range(5):
            await asyncio.sleep(0)
    await stream.aclose()
    check_counters()
    assert registry.in_flight == 0
    # exactly once, in order: what was read is a prefix-respecting, in-order, duplicate-free
    # subsequence of what was delivered (merged outputs stand for consecutive numbers)
    flat = [number for output in read for number in output]
    assert len(flat) == len(set(flat)), f"an output read twice: {read}"
    assert flat == sorted(flat), f"out of order: {read}"
    for output in read:
        assert list(output) == list(range(output[0], output[0] + len(output))), read
    stats = registry.stats()
    if stats.finished == 1 and not stats.failed and "aclose" not in ended_by:
        assert flat == delivered, f"a finished stream read to its end lost outputs: {read}"
    # on_abort exactly once for an abort (a slow consumer's last, finished delivery
    # needs none: the producer is done with it)
    assert len(aborts) <= sum(stats.aborted.values()) <= 1
    if set(stats.aborted) - {"consumer_too_slow"}:
        assert len(aborts) == 1
    assert handled == []


@pytest.mark.parametrize("loop_name", list(LOOPS))
@settings(
    max_examples=400,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(ops=OPS, merge=st.booleans(), max_pending=st.sampled_from([1, 2, 3, 64]))
def test_a_read_stream_keeps_exactly_once_and_order_under_any_interleaving(
    loop_name: str, ops: list[tuple[str, int]], merge: bool, max_pending: int
) -> None:
    with asyncio.Runner(loop_factory=LOOPS[loop_name]) as runner:
        runner.run(_scenario(ops, merge, max_pending))
