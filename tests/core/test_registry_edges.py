"""Re-entrancy, concurrent close, split batches and reference cycles: the registry's edges."""

from __future__ import annotations

import asyncio
import gc

import tether


async def test_on_abort_that_delivers_back_into_the_registry_does_not_break_abort() -> None:
    calls: list[str] = []

    def on_abort(rid: str) -> None:
        calls.append(rid)
        # An engine that answers an abort with a final output: the rid is already freed.
        registry.deliver(rid, "aborted", finished=True)

    registry = tether.Registry(on_abort=on_abort)
    stream = registry.open()
    assert registry.abort(stream.rid) is True
    assert calls == [stream.rid]
    assert registry.in_flight == 0
    stats = registry.stats()
    assert (stats.finished, stats.aborted, stats.late_outputs) == (0, {"server": 1}, 1)
    await stream.aclose()


async def test_on_abort_that_reenters_during_close_leaves_nothing_behind() -> None:
    calls: list[str] = []

    def on_abort(rid: str) -> None:
        calls.append(rid)
        registry.deliver(rid, "aborted", finished=True)

    registry = tether.Registry(on_abort=on_abort)
    streams = [registry.open() for _ in range(3)]
    async with asyncio.timeout(10):
        await registry.close(drain_timeout=0)
    assert sorted(calls) == sorted(stream.rid for stream in streams)
    assert registry.in_flight == 0
    for stream in streams:
        await stream.aclose()


async def test_two_concurrent_closes_both_return_when_the_last_request_finishes() -> None:
    registry = tether.Registry()
    stream = registry.open()
    loop = asyncio.get_running_loop()
    first = asyncio.create_task(registry.close(drain_timeout=30))
    second = asyncio.create_task(registry.close(drain_timeout=30))
    await asyncio.sleep(0)  # both are now waiting for the drain
    started = loop.time()
    registry.deliver(stream.rid, "done", finished=True)
    async with asyncio.timeout(10):
        await asyncio.gather(first, second)
    assert loop.time() - started < 5  # neither waited out its drain_timeout
    assert registry.stats().aborted == {}


async def test_split_batch_failure_keeps_finished_siblings_and_earlier_outputs() -> None:
    registry = tether.Registry()
    batch = registry.open_batch(3)
    done, failing, running = batch.streams
    registry.deliver(done.rid, "final", finished=True)
    registry.deliver(failing.rid, "partial")
    registry.fail(failing.rid, RuntimeError("boom"))
    async with asyncio.timeout(10):
        assert [output async for output in done] == ["final"]
        assert await failing.next_ready() == ["partial"]
        try:
            await failing.next_ready()
        except tether.ProducerError:
            pass
        else:
            raise AssertionError("the failed sub-request must raise after its outputs")
        try:
            await running.next_ready()
        except tether.TetherError:
            pass
        else:
            raise AssertionError("a sibling aborted by the failure must raise")
    assert registry.in_flight == 0
    await batch.aclose()


async def test_a_finished_batch_leaves_nothing_for_the_cyclic_garbage_collector() -> None:
    registry = tether.Registry()
    gc.collect()
    gc.disable()
    try:
        for _ in range(50):
            batch = registry.open_batch(4)
            for rid in batch.rids:
                registry.deliver(rid, rid, finished=True)
            assert len(await batch.result()) == 4
            del batch
        assert gc.collect() == 0
    finally:
        gc.enable()
