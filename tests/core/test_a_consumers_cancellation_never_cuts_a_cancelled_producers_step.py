"""A sink's ``CancelledError`` is its consumer's (its send chain's), and must fail that
consumer alone (invariants 8, 10). The merge tells it apart from the producer's own
cancellation by ``Task.cancelling()``, which stays above zero for the whole of a
cancelled task's clean-up: a producer that flushes its last step while it is being
cancelled (``except CancelledError: deliver_many(...); raise``, an engine's shutdown)
has that step cut at the first sink that raises, and every request after it in the
step never gets its outputs, nor its end."""

from __future__ import annotations

import asyncio
from typing import Any

import tether


def _cancelled_send(outputs: list[Any]) -> bool:
    raise asyncio.CancelledError()  # (a send chain that awaited a cancelled future)


async def test_a_producer_flushing_its_last_step_while_cancelled_delivers_it_to_every_request() -> (
    None
):
    registry = tether.Registry()
    a, b = registry.open(), registry.open()
    for stream in (a, b):
        registry.deliver(stream.rid, "first")
        assert stream.ready() == ["first"]
    assert a.set_sink(_cancelled_send)
    parked = asyncio.Event()

    async def engine() -> None:
        try:
            parked.set()
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            # shutdown: the step that was computed goes out before the task ends
            registry.deliver_many(
                [
                    (a.rid, "x", False),
                    (b.rid, "y", False),
                    (a.rid, "a-end", True),
                    (b.rid, "b-end", True),
                ]
            )
            raise

    task = asyncio.create_task(engine())
    await parked.wait()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    assert registry.in_flight == 0, "the step was cut at a's sink: b never got its outputs"
    assert [output async for output in b] == ["y", "b-end"]
    assert [output async for output in a] == ["x", "a-end"]
