"""Deadlines (per request and per batch) and the registry's drain-then-abort shutdown."""

from __future__ import annotations

import asyncio

import pytest

import tether

from .conftest import AbortLog


async def test_request_past_its_deadline_raises_request_timeout_and_is_aborted(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    stream = registry.open(timeout=0.05)
    registry.deliver(stream.rid, "partial")
    with pytest.raises(tether.RequestTimeout) as caught:
        async with asyncio.timeout(10):
            await stream.result()
    assert isinstance(caught.value, TimeoutError)
    assert caught.value.reason is tether.AbortReason.TIMEOUT
    assert caught.value.timeout == 0.05
    assert registry.in_flight == 0
    assert aborts.calls == {stream.rid: 1}
    assert registry.stats().aborted == {"timeout": 1}


async def test_batch_past_its_deadline_aborts_every_unfinished_sub_request(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    batch = registry.open_batch(3, timeout=0.05)
    done, *unfinished = batch.rids
    registry.deliver(done, "ok", finished=True)
    with pytest.raises(tether.RequestTimeout):
        async with asyncio.timeout(10):
            await batch.result()
    assert registry.in_flight == 0
    assert aborts.calls == dict.fromkeys(unfinished, 1)


async def test_request_finished_before_its_deadline_is_not_aborted_later(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    quick = registry.open(timeout=0.05)
    registry.deliver(quick.rid, "ok", finished=True)
    clock = registry.open(timeout=0.1)  # its timeout tells us the first deadline passed
    with pytest.raises(tether.RequestTimeout):
        async with asyncio.timeout(10):
            await clock.result()
    assert await quick.result() == "ok"
    assert aborts.calls == {clock.rid: 1}


async def test_close_lets_requests_in_flight_finish_within_drain_timeout(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    stream = registry.open()
    started = asyncio.Event()

    async def shut_down() -> None:
        started.set()  # close() then marks the registry closed before it first waits
        await registry.close(drain_timeout=10)

    closing = asyncio.ensure_future(shut_down())
    async with asyncio.timeout(10):
        await started.wait()
    with pytest.raises(tether.RegistryClosed):
        registry.open()
    registry.deliver(stream.rid, "last", finished=True)
    async with asyncio.timeout(10):
        await closing
    assert await stream.result() == "last"
    assert not aborts.calls


async def test_close_drains_then_aborts_the_rest_with_reason_server(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    finishing, stuck = registry.open(), registry.open()
    batch = registry.open_batch(2)
    registry.deliver(finishing.rid, "done", finished=True)
    async with asyncio.timeout(10):
        await registry.close(drain_timeout=0.05)
    assert registry.in_flight == 0
    assert await finishing.result() == "done"
    with pytest.raises(tether.Aborted) as caught:
        await anext(stuck)
    assert caught.value.reason is tether.AbortReason.SERVER
    with pytest.raises(tether.Aborted):
        await batch.result()
    assert aborts.calls == dict.fromkeys([stuck.rid, *batch.rids], 1)
    assert registry.stats().aborted["server"] == 3


async def test_close_is_idempotent(registry: tether.Registry, aborts: AbortLog) -> None:
    stream = registry.open()
    async with asyncio.timeout(10):
        await registry.close(drain_timeout=0)
        await registry.close(drain_timeout=0)
    assert aborts.calls == {stream.rid: 1}
