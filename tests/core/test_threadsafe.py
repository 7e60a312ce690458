"""Producers on another thread hand over to the registry's loop."""

from __future__ import annotations

import asyncio
import threading

import pytest

import tether

from .conftest import AbortLog, hand_over_a_bad_step


async def test_outputs_delivered_from_a_real_thread_arrive_in_order(
    registry: tether.Registry,
) -> None:
    streams = [registry.open() for _ in range(8)]
    rids = [stream.rid for stream in streams]
    steps = 50

    def engine() -> None:
        for step in range(steps):
            registry.deliver_many_threadsafe((rid, (rid, step), step == steps - 1) for rid in rids)

    worker = threading.Thread(target=engine, name="fake-gpu-worker")
    worker.start()
    async with asyncio.timeout(10):
        results = await asyncio.gather(*[_read_all(stream) for stream in streams])
    await asyncio.to_thread(worker.join)
    for rid, outputs in zip(rids, results, strict=True):
        assert outputs == [(rid, step) for step in range(steps)]
    assert registry.in_flight == 0


@pytest.mark.parametrize(
    "bad",
    [("r", "out"), ["r", "out", False, "extra"], (["unhashable"], "out", False), None, "rid"],
)
async def test_a_malformed_step_from_a_thread_is_refused_in_that_thread_whole(
    registry: tether.Registry, bad: object
) -> None:
    received, refused, loop_errors = await hand_over_a_bad_step(registry, lambda _rid: bad)
    assert received == ["after"]  # nothing of the refused step went in
    assert len(refused) == 1
    assert "item 1" in str(refused[0])
    assert loop_errors == []
    assert registry.in_flight == 0


async def _read_all(stream: tether.Stream) -> list[object]:
    return [output async for output in stream]


async def test_deliver_fail_and_abort_from_a_thread(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    delivered, failed, aborted = registry.open(), registry.open(), registry.open()

    def engine() -> None:
        registry.deliver_threadsafe(delivered.rid, "out", finished=True)
        registry.fail_threadsafe(failed.rid, RuntimeError("oom"))
        registry.abort_threadsafe(aborted.rid)

    worker = threading.Thread(target=engine)
    worker.start()
    async with asyncio.timeout(10):
        assert await delivered.result() == "out"
        with pytest.raises(tether.ProducerError):
            await failed.result()
        with pytest.raises(tether.Aborted):
            await aborted.result()
    await asyncio.to_thread(worker.join)
    assert aborts.calls == {aborted.rid: 1}


def test_threadsafe_delivery_before_any_request_was_opened_raises() -> None:
    registry = tether.Registry()
    with pytest.raises(RuntimeError, match="no request was opened"):
        registry.deliver_threadsafe("rid", "out")
