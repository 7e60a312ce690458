"""stop_tasks: an owner stops its tasks; their cancellation ends there, its own goes on."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import types
from collections.abc import Generator

import pytest

from tether.http import Driven, read_ahead, stop_tasks


async def test_stopping_tasks_ends_each_and_raises_nothing_of_theirs() -> None:
    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    tasks = [asyncio.create_task(forever()) for _ in range(3)]
    async with asyncio.timeout(10):
        await started.wait()
        await stop_tasks(tasks)
    assert all(task.cancelled() for task in tasks)


async def test_a_cancellation_of_the_owner_while_it_stops_its_tasks_goes_on() -> None:
    stopping = asyncio.Event()

    async def stubborn() -> None:  # takes a while to end once cancelled
        try:
            await asyncio.Event().wait()
        finally:
            stopping.set()
            await asyncio.Event().wait()

    async def owner(task: asyncio.Task[None]) -> None:
        await stop_tasks((task,))

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)  # one loop turn: the task starts waiting
    stopper = asyncio.create_task(owner(task))
    async with asyncio.timeout(10):
        await stopping.wait()
        stopper.cancel()  # the owner is cancelled while it waits for its task
        with pytest.raises(asyncio.CancelledError):
            await stopper
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_driven_coroutine_runs_to_its_end_without_a_task() -> None:
    gate: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    seen: list[object] = []
    ended = asyncio.Event()

    async def watch() -> None:
        seen.append(asyncio.current_task())  # (run from callbacks: no task of its own)
        seen.append(await gate)
        await asyncio.sleep(0)  # a bare yield: on at the next turn
        seen.append("after a yield")
        ended.set()

    Driven(watch())
    gate.set_result("woken")
    async with asyncio.timeout(10):
        await ended.wait()
    assert seen == [None, "woken", "after a yield"]


async def test_closing_a_driven_coroutine_ends_it_at_once_where_it_waits() -> None:
    waiting, cleaned = asyncio.Event(), []
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def watch() -> None:
        waiting.set()
        try:
            await gate
        finally:
            cleaned.append("finally ran")

    driven = Driven(watch())
    async with asyncio.timeout(10):
        await waiting.wait()
    driven.close()
    assert cleaned == ["finally ran"]  # at once, not at a later turn
    driven.close()  # idempotent
    gate.set_result(None)  # its old wait resolving steps nothing
    await stop_tasks((driven,))  # stop_tasks closes a driven one too, without waiting
    assert cleaned == ["finally ran"]


async def test_a_driven_coroutine_closed_before_its_first_step_never_runs() -> None:
    ran: list[bool] = []

    async def watch() -> None:
        ran.append(True)

    driven = Driven(watch())
    driven.close()
    await asyncio.sleep(0)  # the turn it would have started at
    assert ran == []


async def test_an_error_that_escapes_a_driven_coroutine_is_logged_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    raised = asyncio.Event()

    async def watch() -> None:
        raised.set()
        raise ValueError("broken watch")

    Driven(watch())
    async with asyncio.timeout(10):
        await raised.wait()
    await asyncio.sleep(0)  # (the step that raised has returned)
    assert any("broken watch" in repr(record.exc_info) for record in caplog.records)


class _Cycle:  # a server's request cycle, as uvicorn names its module
    __module__ = "uvicorn.protocols.http.httptools_impl"

    async def receive(self) -> dict[str, str]:
        return {"type": "http.disconnect"}


async def test_read_ahead_drives_the_servers_own_receive_and_gives_a_wrapper_a_task() -> None:
    queue: asyncio.Queue[dict[str, str]] = asyncio.Queue()
    cycle = _Cycle()

    async def wrapped() -> dict[str, str]:  # a middleware's receive: it may want a task
        return await cycle.receive()

    async def reader(receive: object) -> None:
        await asyncio.Event().wait()

    for receive in (cycle.receive, queue.get):
        watch = read_ahead(reader(receive), receive)
        assert isinstance(watch, Driven), receive
        await stop_tasks((watch,))
    watch = read_ahead(reader(wrapped), wrapped)
    assert not isinstance(watch, Driven)  # a task (of the loop's task factory)
    await stop_tasks((watch,))
    assert watch.cancelled()


async def test_a_driven_coroutine_closed_from_inside_itself_is_never_stepped_again() -> None:
    """Re-entrancy: what it calls closes it (a disconnect whose hook ends the request's
    read), then it goes on to its next wait. It ends there, its ``finally`` runs once,
    and the wait resolving later steps nothing."""
    loop = asyncio.get_running_loop()
    gate: asyncio.Future[None] = loop.create_future()
    later: asyncio.Future[None] = loop.create_future()
    seen: list[str] = []
    watching: list[Driven] = []
    waiting, ended = asyncio.Event(), asyncio.Event()

    async def watch() -> None:
        waiting.set()
        try:
            await gate
            watching[0].close()  # from inside: it runs now, so it is not closed here
            seen.append("went on")
            await later
            seen.append("stepped again")
        finally:
            seen.append("finally ran")
            ended.set()

    watching.append(Driven(watch()))
    async with asyncio.timeout(10):
        await waiting.wait()
        gate.set_result(None)
        await ended.wait()
    assert seen == ["went on", "finally ran"]
    later.set_result(None)
    await asyncio.sleep(0)  # the turn its old wait's callback runs at
    watching[0].close()  # and closing again does nothing
    await stop_tasks(watching)
    assert seen == ["went on", "finally ran"]


async def test_a_driven_coroutine_whose_wait_is_cancelled_meets_the_cancellation_there() -> None:
    loop = asyncio.get_running_loop()
    gate: asyncio.Future[None] = loop.create_future()
    seen: list[str] = []
    waiting, ended = asyncio.Event(), asyncio.Event()

    async def watch() -> None:
        waiting.set()
        try:
            await gate
        except asyncio.CancelledError:
            seen.append("cancelled where it waited")
        ended.set()

    Driven(watch())
    async with asyncio.timeout(10):
        await waiting.wait()
        gate.cancel()
        await ended.wait()
    assert seen == ["cancelled where it waited"]


_LABEL: contextvars.ContextVar[str] = contextvars.ContextVar("label", default="none")


async def test_a_driven_coroutine_keeps_one_context_across_its_waits() -> None:
    """As a task would: a context variable it sets before a wait is reset after it (a
    logging or tracing helper around an await), and nothing it sets reaches its maker."""
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    seen: list[str] = []
    waiting, ended = asyncio.Event(), asyncio.Event()

    async def watch() -> None:
        token = _LABEL.set("watching")
        waiting.set()
        try:
            await gate
            seen.append(_LABEL.get())
        finally:
            try:
                _LABEL.reset(token)
                seen.append("reset")
            except ValueError as exc:  # "created in a different Context"
                seen.append(repr(exc))
            ended.set()

    Driven(watch())
    async with asyncio.timeout(10):
        await waiting.wait()  # it waits on the gate: the rest is another step
        gate.set_result(None)
        await ended.wait()
    assert seen == ["watching", "reset"]
    assert _LABEL.get() == "none"


async def test_stopping_tasks_cancels_every_one_even_if_a_driven_one_fails_as_it_closes() -> None:
    """A driven coroutine whose cleanup raises: the error is the caller's, as a task's
    would be, but only once every other task given was cancelled too."""
    started, waiting = asyncio.Event(), asyncio.Event()

    async def cleanup_fails() -> None:
        waiting.set()
        try:
            await asyncio.Event().wait()
        finally:
            raise ValueError("its cleanup failed")

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    driven = Driven(cleanup_fails())
    task = asyncio.create_task(forever())
    try:
        async with asyncio.timeout(10):
            await waiting.wait()
            await started.wait()
            with pytest.raises(ValueError, match="its cleanup failed"):
                await stop_tasks((driven, task))
            assert task.cancelling() or task.done()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_driven_coroutine_that_awaits_no_future_meets_the_error_where_it_waits() -> None:
    """Misuse (an awaitable that yields something other than a future, which only a
    task of another library would drive): as in a task, the coroutine meets a clear
    error where it awaited and ends; nothing reaches the loop's exception handler."""
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _, context: unhandled.append(context))
    seen: list[str] = []
    ended = asyncio.Event()

    @types.coroutine
    def foreign() -> Generator[str, None, None]:
        yield "not a future"

    async def watch() -> None:
        try:
            await foreign()
        except RuntimeError:
            seen.append("refused where it waited")
        finally:
            ended.set()

    driven = Driven(watch())
    try:
        async with asyncio.timeout(2):
            await ended.wait()
    except TimeoutError:
        driven.close()  # (it would wait for good: the test ends, and says so)
    finally:
        loop.set_exception_handler(None)
    assert seen == ["refused where it waited"]
    assert unhandled == []
