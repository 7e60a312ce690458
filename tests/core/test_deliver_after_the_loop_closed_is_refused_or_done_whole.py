"""``Registry.deliver()`` called in the loop's thread after the loop closed (an engine's
shutdown path delivering its last outputs once ``asyncio.run`` returned) never raises
a bare ``RuntimeError`` from inside (Invariant 10): it is refused at once with a typed
error, nothing changed (Invariant 13), or done whole, the request ended and its rid
free again, never ended and counted with the producer's ``on_abort`` stuck behind a
closed loop and the rid held for ever."""

from __future__ import annotations

import asyncio

import tether


def test_deliver_after_the_loop_closed_is_refused_or_done_whole() -> None:
    told: list[str] = []
    registry = tether.Registry(told.append, max_pending=1)

    async def open_one() -> tether.Stream:
        stream = registry.open("late")
        registry.deliver("late", 1)  # (its first output: the loop is checked here)
        return stream

    loop = asyncio.new_event_loop()
    stream = loop.run_until_complete(open_one())
    loop.close()
    try:
        registry.deliver("late", 2)
        registry.deliver("late", 3)  # more than max_pending wait: the request ends
    except tether.TetherError:
        assert registry.in_flight == 1  # refused, typed, nothing changed
        return
    assert registry.in_flight == 0
    assert told == ["late"]

    async def next_loop() -> None:
        registry.open("late").cancel()  # the rid is free again

    asyncio.run(next_loop())
    assert stream.rid == "late"
