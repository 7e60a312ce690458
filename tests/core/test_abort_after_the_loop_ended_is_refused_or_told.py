"""``Registry.abort()`` called in the loop's thread once the loop has stopped (a
shutdown hook that runs after ``asyncio.run`` returned) is misuse or a late abort:
either refused at once with a typed error, nothing changed (Invariant 13), or done
whole, the request ended and its rid free again. Never a bare ``RuntimeError`` from
inside, the request counted aborted, the asynchronous ``on_abort`` never awaited and
the rid held for ever."""

from __future__ import annotations

import asyncio

import tether


def test_abort_with_an_async_on_abort_and_no_loop_running_is_refused_or_done_whole() -> None:
    told: list[str] = []

    async def on_abort(rid: str) -> None:
        told.append(rid)

    registry = tether.Registry(on_abort)

    async def open_one() -> tether.Stream:
        return registry.open("late")

    stream = asyncio.run(open_one())
    try:
        registry.abort(stream.rid)
    except tether.TetherError:
        assert registry.in_flight == 1  # refused, typed, nothing changed
        return
    assert registry.in_flight == 0

    async def next_loop() -> None:
        registry.open("late")  # the rid is free again

    asyncio.run(next_loop())
