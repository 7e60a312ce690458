"""RequestScope: streams opened in it are tracked, cancelled together, closed at exit."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import weakref

import pytest

import tether
import tether.http
import tether.resume

from .conftest import AbortLog


async def test_disconnect_cancels_every_stream_of_the_scope_at_once(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    with tether.RequestScope() as scope:
        stream = registry.open()
        batch = registry.open_batch(2)
        finished = registry.open()
        registry.deliver(finished.rid, "ok", finished=True)
        waiting = asyncio.ensure_future(anext(stream))
        assert scope.disconnect() == 2  # the stream and the batch were live
        assert scope.disconnected
        assert registry.in_flight == 0
        with pytest.raises(tether.Aborted) as caught:
            async with asyncio.timeout(10):
                await waiting
        assert caught.value.reason is tether.AbortReason.CLIENT_DISCONNECTED
        with pytest.raises(tether.Aborted):
            await batch.result()
        assert await finished.result() == "ok"
    assert aborts.calls == dict.fromkeys([stream.rid, *batch.rids], 1)


async def test_disconnect_is_idempotent_and_later_opens_in_the_scope_raise_aborted(
    registry: tether.Registry,
) -> None:
    with tether.RequestScope() as scope:
        registry.open()
        assert scope.disconnect() == 1
        assert scope.disconnect() == 0
        with pytest.raises(tether.Aborted):
            registry.open()
        with pytest.raises(tether.Aborted):
            registry.open_batch(2)
    assert registry.in_flight == 0


async def test_leaving_the_scope_closes_what_the_handler_left_open(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    async with tether.RequestScope():
        left_open = registry.open()
        finished = registry.open()
        registry.deliver(finished.rid, "ok", finished=True)
    assert registry.in_flight == 0
    assert aborts.calls == {left_open.rid: 1}
    assert registry.stats().aborted == {"cancelled": 1}


async def test_scope_is_current_inside_and_follows_into_tasks(
    registry: tether.Registry,
) -> None:
    assert tether.http.current_scope() is None
    with tether.RequestScope() as scope:
        assert tether.http.current_scope() is scope

        async def open_in_task() -> tether.Stream:
            return registry.open()

        stream = await asyncio.ensure_future(open_in_task())
        scope.disconnect()
        with pytest.raises(tether.Aborted):
            await stream.result()  # tracked by the scope though opened in another task
    assert tether.http.current_scope() is None


def test_a_scope_can_be_entered_only_once() -> None:
    scope = tether.RequestScope()
    with scope, pytest.raises(RuntimeError, match="only once"):
        scope.__enter__()


async def test_close_counts_what_was_still_live(registry: tether.Registry) -> None:
    scope = tether.RequestScope()
    scope.track(registry.open())
    scope.track(registry.open_batch(2))
    assert scope.close() == 2
    assert scope.close() == 0
    assert registry.in_flight == 0


async def test_cancelling_a_wait_when_the_client_is_gone_counts_as_a_disconnect() -> None:
    registry = tether.Registry()
    gone = False
    with tether.RequestScope(client_gone=lambda: gone) as scope:
        first, second = registry.open(), registry.open()
        waiter = asyncio.ensure_future(first.result())
        await asyncio.sleep(0)  # the waiter parks
        gone = True
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
    assert scope.disconnected
    assert second.finished  # the whole scope was disconnected, not just the waiter's stream
    assert registry.stats().aborted == {"client_disconnected": 2}


async def test_cancelling_a_wait_while_the_client_is_there_is_a_plain_cancellation() -> None:
    registry = tether.Registry()
    with tether.RequestScope(client_gone=lambda: False) as scope:
        stream = registry.open()
        waiter = asyncio.ensure_future(stream.result())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
    assert not scope.disconnected
    assert registry.stats().aborted == {"cancelled": 1}


async def test_a_long_lived_scope_lets_go_of_the_streams_that_ended(
    registry: tether.Registry,
) -> None:
    kept: list[weakref.ref[tether.Stream]] = []
    with tether.RequestScope() as scope:
        live = registry.open()
        for _ in range(2_000):  # an agent loop or a WebSocket handler, one stream after another
            stream = registry.open()
            kept.append(weakref.ref(stream))
            registry.deliver(stream.rid, "x", finished=True)
            assert await stream.result() == "x"
            await stream.aclose()
            del stream
        gone = sum(ref() is None for ref in kept)
        assert gone >= 1_800  # the scope held on to at most a bounded tail of them
        assert scope.disconnect() == 1  # and still cancels what is live
    assert registry.in_flight == 0
    with pytest.raises(tether.Aborted):
        await live.result()


async def test_a_stream_opened_under_an_ended_scope_is_not_adopted_by_it() -> None:
    # What a task inherits when it was started while a finished request's scope was
    # current: a handler's background task, or code outside the middleware.
    aborted: list[str] = []
    registry = tether.Registry(aborted.append)
    scope = tether.RequestScope()
    with scope:
        inherited = contextvars.copy_context()

    stream = inherited.run(registry.open)
    scope.disconnect()  # a late signal for the ended request

    assert stream.rid in registry
    assert aborted == []
    await stream.aclose()


async def test_a_wait_of_the_request_starts_the_watch_of_its_client() -> None:
    watched: list[str] = []
    with tether.RequestScope(on_first_track=lambda: watched.append("watch")) as scope:
        with scope.waiting():
            assert watched == ["watch"]  # before anything is tracked
        with scope.waiting():
            pass
    assert watched == ["watch"]  # once


async def test_a_client_that_leaves_during_a_wait_cuts_it_at_once() -> None:
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiting = asyncio.Event()
    with tether.RequestScope() as scope:

        async def wait() -> None:
            with scope.waiting():
                waiting.set()
                await never

        task = asyncio.create_task(wait())
        async with asyncio.timeout(10):
            await waiting.wait()
            scope.disconnect()
            with pytest.raises(tether.Aborted) as caught:
                await task
    assert caught.value.reason is tether.AbortReason.CLIENT_DISCONNECTED
    assert task.cancelling() == 0  # the cut is taken back: nothing owed to the task
    never.cancel()


@pytest.mark.parametrize("then", ["waits-on", "completes"])
async def test_a_wait_that_drops_its_cut_still_ends_aborted(then: str) -> None:
    """A cancellation can be lost on its way (3.11's ``asyncio.wait_for`` drops one that
    arrives as what it wraps completes): a wait that goes on is cut again, and one that
    completes all the same ends ``Aborted`` as well; the wait must not outlive its
    client, nor answer it."""
    waiting = asyncio.Event()
    with tether.RequestScope() as scope:

        async def wait() -> None:
            with scope.waiting():
                waiting.set()
                with contextlib.suppress(asyncio.CancelledError):  # the cut, dropped
                    await asyncio.Event().wait()
                assert tether.resume.wait_withdrawn()  # (a store looks before a claim)
                if then == "waits-on":
                    await asyncio.Event().wait()

        task = asyncio.create_task(wait())
        async with asyncio.timeout(10):
            await waiting.wait()
            scope.disconnect()
            with pytest.raises(tether.Aborted) as caught:
                await task
    assert caught.value.reason is tether.AbortReason.CLIENT_DISCONNECTED
    assert task.cancelling() == 0
    assert not tether.resume.wait_withdrawn()  # (not waiting here)


async def _waiting_for_ever(scope: tether.RequestScope) -> asyncio.Task[None]:
    """A task that waits for ever under ``scope.waiting()``, once it waits."""
    waiting = asyncio.Event()

    async def wait() -> None:
        with scope.waiting():
            waiting.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(wait())
    await waiting.wait()
    return task


async def test_the_end_of_the_request_cuts_a_wait_that_outlives_it() -> None:
    with tether.RequestScope() as scope:
        task = await _waiting_for_ever(scope)  # (a task of the handler's that outlives it)
    async with asyncio.timeout(10):
        with pytest.raises(tether.Aborted) as caught:
            await task
    assert caught.value.reason is tether.AbortReason.CANCELLED
    assert not scope.disconnected
    assert task.cancelling() == 0


async def test_a_client_gone_before_the_wait_ends_it_before_it_starts() -> None:
    watched: list[str] = []
    with tether.RequestScope(on_first_track=lambda: watched.append("watch")) as scope:
        scope.disconnect()
        with pytest.raises(tether.Aborted), scope.waiting():
            pytest.fail("a wait for a client that left")
    assert watched == []


async def test_a_wait_cancelled_by_someone_else_stays_a_cancellation() -> None:
    with tether.RequestScope() as scope:
        async with asyncio.timeout(10):
            task = await _waiting_for_ever(scope)
            task.cancel()
            scope.disconnect()  # the client leaves too: the cancellation still goes on
            with pytest.raises(asyncio.CancelledError):
                await task
    assert task.cancelled()


async def test_a_client_that_leaves_after_the_wait_cancels_nothing_more() -> None:
    with tether.RequestScope() as scope:
        with scope.waiting():
            await asyncio.sleep(0)
        scope.disconnect()
        await asyncio.sleep(0)  # no cancellation lands here
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
