"""What ``Stream.__anext__`` returns behaves as a read: on asyncio's loop and on uvloop,
whatever a caller does with it (wraps it in a task, cancels it before it runs, cancels
it after it returned, polls it with a zero timeout, drops the stream after it), every
output is read exactly once, in order, nothing is aborted that was not cancelled, and a
stream read and dropped is freed at once by reference counting."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import warnings
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest
import uvloop

import tether

from .conftest import AbortLog

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


@pytest.fixture(params=list(LOOPS))
def run(request: pytest.FixtureRequest) -> Iterator[Callable[[Coroutine[Any, Any, Any]], Any]]:
    """Run a coroutine on a fresh loop of the parametrised kind; fail the test on
    anything that reached the loop's exception handler."""
    handled: list[dict[str, Any]] = []

    def runner(coro: Coroutine[Any, Any, Any]) -> Any:
        with asyncio.Runner(loop_factory=LOOPS[request.param]) as r:
            r.get_loop().set_exception_handler(lambda _loop, context: handled.append(context))
            return r.run(coro)

    yield runner
    assert handled == []


async def _read_one(stream: tether.Stream) -> Any:
    return await anext(stream)


async def _parked(task: asyncio.Task[Any]) -> None:
    """Let ``task`` run until it waits (a few turns of the loop, no timing)."""
    for _ in range(5):
        await asyncio.sleep(0)
    assert not task.done(), f"the reader did not wait: {task!r}"


def test_a_read_wrapped_in_a_task_waits_for_and_returns_the_next_output(run: Any) -> None:
    aborts = AbortLog()

    async def main() -> None:
        registry = tether.Registry(aborts)
        async with registry.open() as stream:
            # asyncio.create_task(anext(it)): the usual way to race a read against
            # something else; it must work whether or not an output is ready.
            read = asyncio.create_task(anext(stream))
            await _parked(read)
            registry.deliver(stream.rid, "a")
            assert await read == "a"
            registry.deliver(stream.rid, "b", finished=True)
            assert [output async for output in stream] == ["b"]
        assert registry.in_flight == 0

    run(main())
    assert aborts.calls == {}


def test_a_read_whose_task_is_cancelled_before_it_ran_loses_no_output(run: Any) -> None:
    aborts = AbortLog()

    async def main_live() -> None:
        registry = tether.Registry(aborts)
        async with registry.open() as stream:
            registry.deliver(stream.rid, "a")
            registry.deliver(stream.rid, "b")
            read = asyncio.ensure_future(anext(stream))
            read.cancel()
            with pytest.raises(asyncio.CancelledError):
                await read
            if stream.finished:  # the cancelled read was an abort: nothing more to check
                assert aborts.calls == {stream.rid: 1}
                return
            registry.deliver(stream.rid, "c", finished=True)
            rest = [output async for output in stream]
            assert rest == ["a", "b", "c"], f"an output was lost: {rest!r}"

    run(main_live())


def test_a_zero_timeout_poll_of_a_ready_read_returns_it_or_leaves_it(run: Any) -> None:
    """``wait_for(anext(stream), 0)``: on 3.11 the read is wrapped in a task and cancelled
    before it runs; the output must then still be the next one read."""

    async def main() -> None:
        registry = tether.Registry(AbortLog())
        async with registry.open() as stream:
            registry.deliver(stream.rid, 1)
            registry.deliver(stream.rid, 2)
            got: list[Any] = []
            try:
                got.append(await asyncio.wait_for(anext(stream), 0))
            except TimeoutError:
                pass
            registry.deliver(stream.rid, 3, finished=True)
            got += [output async for output in stream]
            assert got == [1, 2, 3], f"exactly once, in order: got {got!r}"

    run(main())


def test_cancelling_a_read_that_already_returned_changes_nothing(run: Any) -> None:
    """``Future.cancel()`` on a done read is a no-op (cleanup code cancels every read
    it started, done or not): no abort, no output read twice."""
    aborts = AbortLog()

    async def main() -> None:
        registry = tether.Registry(aborts)
        first, second = registry.open(), registry.open()
        reads = [asyncio.ensure_future(anext(first)), asyncio.ensure_future(anext(second))]
        await asyncio.sleep(0)
        registry.deliver(first.rid, "a")
        done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
        assert [read.result() for read in done] == ["a"]
        for read in reads:  # the usual cleanup: cancel whatever was started
            read.cancel()
        await asyncio.wait(reads)
        assert aborts.calls.keys() <= {second.rid}, "the read that returned aborted its stream"
        assert not first.finished
        registry.deliver(first.rid, "b", finished=True)
        assert [output async for output in first] == ["b"], "an output was read twice"
        await first.aclose()
        await second.aclose()
        assert registry.in_flight == 0

    run(main())


def test_cancelling_a_finished_read_after_the_last_output_reads_nothing_twice(
    run: Any,
) -> None:
    async def main() -> None:
        registry = tether.Registry(AbortLog())
        async with registry.open() as stream:
            read = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0)  # it waits
            registry.deliver(stream.rid, "last", finished=True)
            assert await read == "last"
            read.cancel()  # a no-op on a done read
            assert [output async for output in stream] == []

    run(main())


def test_a_stream_read_then_dropped_is_freed_at_once_by_reference_counting(
    run: Any,
) -> None:
    """The core promises no reference cycle: a stream dropped unclosed is aborted by its
    ``__del__`` when its last reference goes, not at some later cyclic collection."""
    aborts = AbortLog()

    async def main() -> None:
        registry = tether.Registry(aborts)
        stream = registry.open()
        reader = asyncio.create_task(_read_one(stream))
        await _parked(reader)  # it waits: the read is handed the output by deliver()
        registry.deliver(stream.rid, "a")
        assert await reader == "a"
        del reader
        gc.disable()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ResourceWarning)
                del stream
            assert registry.in_flight == 0, "the dropped stream was not freed at once"
        finally:
            gc.enable()
            gc.collect()
        await aborts.wait_for(1)

    run(main())


def test_anext_with_a_default_returns_it_at_the_end_after_a_wait(run: Any) -> None:
    async def main() -> None:
        registry = tether.Registry(AbortLog())
        async with registry.open() as stream:
            read = asyncio.ensure_future(anext(stream, "default"))
            await asyncio.sleep(0)
            registry.deliver(stream.rid, "a")
            assert await read == "a"
            read = asyncio.ensure_future(anext(stream, "default"))
            await asyncio.sleep(0)
            registry.fail(stream.rid, RuntimeError("x"))
            with pytest.raises(tether.ProducerError):
                await read
        async with registry.open() as stream:
            read = asyncio.ensure_future(anext(stream, "default"))
            await asyncio.sleep(0)
            registry.deliver(stream.rid, "a", finished=True)
            assert await read == "a"
            assert await anext(stream, "default") == "default"

    run(main())


def test_a_reader_cancelled_while_waiting_aborts_once_with_its_scope_told(run: Any) -> None:
    """A framework that cancels the handler when its client leaves (aiohttp's
    ``handler_cancellation``) cancels it from a transport callback, outside the
    request's context: the scope must still be asked whether the client left."""
    aborts = AbortLog()

    async def main() -> None:
        registry = tether.Registry(aborts)
        gone = True
        scope = tether.RequestScope(client_gone=lambda: gone)

        async def handler() -> list[Any]:
            with scope:
                stream = registry.open()
                return [output async for output in stream]

        # the handler runs in a context of its own (as a server's task does)
        task = asyncio.get_running_loop().create_task(handler())
        await _parked(task)
        # the cancel comes from a callback scheduled outside the handler's context
        cancelled = asyncio.Event()
        asyncio.get_running_loop().call_soon(
            lambda: (task.cancel(), cancelled.set()),
            context=contextvars.Context(),
        )
        await cancelled.wait()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert registry.in_flight == 0
        assert sum(aborts.calls.values()) == 1
        assert dict(registry.stats().aborted) == {"client_disconnected": 1}

    run(main())


def test_a_cancel_inside_merge_of_the_readers_own_task_ends_the_request_once(
    run: Any,
) -> None:
    """``merge`` (run inside ``deliver()``) cancels the task reading its stream while that
    task was handed an output but has not resumed: the request ends exactly once, the
    counters add up, nothing reaches the producer or the loop's handler."""
    aborts = AbortLog()

    async def main() -> None:
        tasks: list[asyncio.Task[Any]] = []

        def merge(acc: Any, new: Any) -> Any:
            for task in tasks:
                task.cancel()
            return acc + new

        registry = tether.Registry(aborts, merge=merge)
        stream = registry.open()

        async def read() -> list[Any]:
            return [output async for output in stream]

        tasks.append(asyncio.create_task(read()))
        await _parked(tasks[0])
        assert registry.deliver(stream.rid, 1)  # handed to the parked reader
        assert registry.deliver(stream.rid, 2)  # waits
        assert registry.deliver(stream.rid, 3) in (True, False)  # merges: cancels the reader
        with pytest.raises(asyncio.CancelledError):
            await tasks[0]
        await aborts.wait_for(1)
        stats = registry.stats()
        assert stats.opened == stats.finished + stats.failed + sum(stats.aborted.values())
        assert registry.in_flight == 0
        assert aborts.calls == {stream.rid: 1}
        await stream.aclose()

    run(main())


def test_a_refused_second_read_leaves_the_waiting_read_an_abort_when_cancelled(
    run: Any,
) -> None:
    """A read refused with ConcurrentRead changes nothing: the read still waiting (here
    held as a future by the same task, which polls it) is cancelled as any read is, an
    abort, and the next ``deliver()`` is not failed by what the refused read left."""
    aborts = AbortLog()

    async def main() -> None:
        registry = tether.Registry(aborts)
        stream = registry.open()
        first = asyncio.ensure_future(anext(stream))
        _, pending = await asyncio.wait([first], timeout=0)  # polled: still waiting
        assert pending == {first}
        with pytest.raises(tether.ConcurrentRead):
            await anext(stream)
        first.cancel()
        await asyncio.wait([first])
        assert first.cancelled()
        assert registry.in_flight == 0, "the cancelled read did not abort its request"
        assert registry.deliver(stream.rid, "late") is False
        await aborts.wait_for(1)
        assert aborts.calls == {stream.rid: 1}
        assert dict(registry.stats().aborted) == {"cancelled": 1}
        assert registry.stats().failed == 0
        await stream.aclose()

    run(main())


def test_a_read_from_another_thread_is_refused_before_it_takes_anything(run: Any) -> None:
    async def main() -> None:
        registry = tether.Registry(AbortLog())
        async with registry.open() as stream:
            registry.deliver(stream.rid, "a")

            async def read_there() -> Any:
                return await anext(stream)

            raised = await asyncio.to_thread(lambda: _raised(lambda: asyncio.run(read_there())))
            assert isinstance(raised, tether.WrongLoop), raised
            registry.deliver(stream.rid, "b", finished=True)
            assert [output async for output in stream] == ["a", "b"]

    run(main())


def test_a_waiting_read_from_another_thread_is_refused_and_changes_nothing(run: Any) -> None:
    async def main() -> None:
        registry = tether.Registry(AbortLog())
        async with registry.open() as stream:

            async def read_there() -> Any:
                return await anext(stream)

            raised = await asyncio.to_thread(lambda: _raised(lambda: asyncio.run(read_there())))
            assert isinstance(raised, tether.WrongLoop), raised
            registry.deliver(stream.rid, "a", finished=True)
            assert [output async for output in stream] == ["a"]
        assert registry.stats().finished == 1

    run(main())


def _raised(call: Callable[[], Any]) -> BaseException | None:
    try:
        call()
    except BaseException as exc:  # handed to the test, which judges it
        return exc
    return None
