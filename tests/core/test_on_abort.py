"""on_abort: exactly once for every request closed before it finished, never otherwise."""

from __future__ import annotations

import asyncio
import logging

import pytest

import tether

from .conftest import AbortLog


async def test_on_abort_is_called_once_however_many_ways_a_stream_is_closed(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    with tether.RequestScope() as scope:
        stream = registry.open()
        stream.cancel()
        scope.disconnect()
        registry.abort(stream.rid)
        await stream.aclose()
    assert aborts.calls == {stream.rid: 1}


async def test_on_abort_is_never_called_for_finished_or_failed_requests(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    with tether.RequestScope():
        finished, failed = registry.open(), registry.open()
        registry.deliver(finished.rid, 1, finished=True)
        registry.fail(failed.rid, RuntimeError("boom"))
        await finished.aclose()
        failed.cancel()
    assert not aborts.calls


async def test_async_on_abort_is_awaited_once() -> None:
    called: list[str] = []
    done = asyncio.Event()

    async def on_abort(rid: str) -> None:
        await asyncio.sleep(0)  # a real await point inside the callback
        called.append(rid)
        done.set()

    registry = tether.Registry(on_abort)
    stream = registry.open()
    await stream.aclose()
    await stream.aclose()
    async with asyncio.timeout(10):
        await done.wait()
        await registry.close()
    assert called == [stream.rid]


async def test_on_abort_that_raises_is_logged_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def on_abort(rid: str) -> None:
        raise RuntimeError("engine unreachable")

    registry = tether.Registry(on_abort)
    stream = registry.open()
    with caplog.at_level(logging.ERROR, logger="tether"):
        await stream.aclose()
        assert registry.abort(registry.open().rid)
    assert registry.in_flight == 0
    assert len([r for r in caplog.records if "on_abort" in r.getMessage()]) == 2


async def test_async_on_abort_that_raises_is_logged_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def on_abort(rid: str) -> None:
        raise RuntimeError("engine unreachable")

    registry = tether.Registry(on_abort)
    with caplog.at_level(logging.ERROR, logger="tether"):
        await registry.open().aclose()
        async with asyncio.timeout(10):
            await registry.close()
    assert [r for r in caplog.records if "raised" in r.getMessage()]


async def test_async_on_abort_that_hangs_is_bounded_by_abort_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cancelled = asyncio.Event()

    async def on_abort(rid: str) -> None:
        try:
            await asyncio.Event().wait()  # never set: the engine does not answer
        finally:
            cancelled.set()

    registry = tether.Registry(on_abort, abort_timeout=0.05)
    with caplog.at_level(logging.ERROR, logger="tether"):
        await registry.open().aclose()
        async with asyncio.timeout(10):
            await registry.close(drain_timeout=0)
            await cancelled.wait()
    assert [r for r in caplog.records if "took longer" in r.getMessage()]


async def test_abort_from_inside_deliver_defers_on_abort_until_deliver_returned(
    aborts: AbortLog,
) -> None:
    registry = tether.Registry(aborts, max_pending=1)
    stream = registry.open()
    registry.deliver(stream.rid, 1)
    registry.deliver(stream.rid, 2)  # too slow: aborted inside the producer's call
    assert not aborts.calls  # on_abort does not re-enter the producer
    await aborts.wait_for(1)
    assert aborts.calls == {stream.rid: 1}
