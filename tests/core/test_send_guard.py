"""SendGuard and the bounded writes of Exchange.run: a write past the limit is abandoned."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import tether
import tether.http
from tether._guard import SendGuard

from .conftest import AbortLog


async def test_a_write_that_never_completes_is_abandoned_after_the_limit() -> None:
    guard = SendGuard(0.05)
    loop = asyncio.get_running_loop()
    blocked: asyncio.Future[None] = loop.create_future()
    async with asyncio.timeout(10):
        started = loop.time()
        assert await guard.write(blocked) is False
        waited = loop.time() - started
        assert guard.stalled
        # The task was not left cancelled: it goes on awaiting normally.
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
        await asyncio.sleep(0)
    assert waited >= 0.05 - 0.002
    assert blocked.cancelled()


async def test_writes_that_complete_are_never_abandoned_and_arm_few_timers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    guard = SendGuard(30)
    loop = asyncio.get_running_loop()
    armed = 0
    call_later = loop.call_later

    def counting(delay: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
        nonlocal armed
        if getattr(callback, "__name__", "") == "_tick":
            armed += 1
        return call_later(delay, callback, *args)

    monkeypatch.setattr(loop, "call_later", counting)

    async def one_turn() -> None:
        await asyncio.sleep(0)

    async with asyncio.timeout(10):
        results = [await guard.write(one_turn()) for _ in range(500)]
    guard.close()
    assert all(results)
    assert not guard.stalled
    assert armed == 1


async def test_an_outside_cancellation_during_a_write_still_cancels_the_task() -> None:
    guard = SendGuard(30)
    loop = asyncio.get_running_loop()
    blocked: asyncio.Future[None] = loop.create_future()
    writer = asyncio.create_task(guard.write(blocked))
    await asyncio.sleep(0)
    writer.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(10):
            await writer
    guard.close()
    assert not guard.stalled


async def test_without_a_limit_writes_are_awaited_as_they_are() -> None:
    guard = SendGuard(None)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    done.set_result(None)
    assert await guard.write(done) is True


class _Stuck:
    """A writer whose client reads nothing: every write waits for ever."""

    lost_when_cut = True

    def __init__(self) -> None:
        self.dropped = False

    def start(self) -> asyncio.Future[None]:
        return asyncio.get_running_loop().create_future()

    write = start  # type: ignore[assignment]

    async def answer(self, head: tether.http.Head) -> None:
        raise AssertionError("a stalled client gets no farewell")

    def drop(self) -> None:
        self.dropped = True

    def direct(self) -> None:
        return None


async def test_bounded_write_past_the_limit_aborts_the_request(
    aborts: AbortLog,
) -> None:
    registry = tether.Registry(on_abort=aborts)
    writer = _Stuck()
    with tether.RequestScope() as scope:
        stream = registry.open()
        exchange = tether.http.Exchange(stream, streaming=True, send_timeout=0.05, scope=scope)
        async with asyncio.timeout(10):
            await exchange.run(writer, b"")  # returns: the client counts as gone
    assert exchange.done
    assert writer.dropped
    assert scope.disconnected
    assert aborts.calls == {stream.rid: 1}
    assert registry.in_flight == 0
    await exchange.aclose()
