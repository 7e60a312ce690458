"""An asynchronous ``on_abort`` told while the registry's loop is merely stopped (between
two ``run_until_complete`` calls, the loop neither closed nor gone) is still awaited
once the loop runs again (Invariant 3): the loop is known and can take a task, so the
producer hears of the abort rather than a log line saying it never will."""

from __future__ import annotations

import asyncio

import tether


def test_an_async_on_abort_told_between_runs_of_its_loop_is_awaited() -> None:
    told: list[str] = []

    async def on_abort(rid: str) -> None:
        told.append(rid)

    registry = tether.Registry(on_abort)
    loop = asyncio.new_event_loop()
    try:

        async def open_one() -> tether.Stream:
            return registry.open("between-runs")

        stream = loop.run_until_complete(open_one())
        registry.abort(stream.rid)  # the loop's thread, the loop stopped, not closed

        async def later() -> None:
            await registry.close(drain_timeout=0)

        loop.run_until_complete(later())
    finally:
        loop.close()
    assert told == ["between-runs"]
