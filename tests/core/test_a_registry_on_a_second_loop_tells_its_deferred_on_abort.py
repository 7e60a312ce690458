"""A registry whose requests have all ended may open on another event loop (the table
rebinds to it). A request ended inside the producer's step on that loop has its
``on_abort`` told soon after the step, as on the first loop, whatever was left
scheduled on a loop that stopped before running it."""

from __future__ import annotations

import asyncio

import tether


class Told:
    """``on_abort``: records each rid, and wakes whoever waits for one more."""

    def __init__(self) -> None:
        self.rids: list[str] = []
        self.changed: asyncio.Event | None = None

    def __call__(self, rid: str) -> None:
        self.rids.append(rid)
        if self.changed is not None:
            self.changed.set()


def test_a_request_ended_in_a_step_on_the_second_loop_is_told_soon() -> None:
    told = Told()
    registry = tether.Registry(told)

    # The first loop stops right after a producer's step that ended "b" (a loop run
    # by hand, stopped by the engine's shutdown): its deferred call never ran there.
    first = asyncio.new_event_loop()

    async def open_two() -> tuple[tether.Stream, tether.Stream]:
        a = registry.open("a")
        b = registry.open("b")
        a.set_sink(lambda outputs: registry.abort("b") or True)
        return a, b

    a, b = first.run_until_complete(open_two())

    def last_step() -> None:
        registry.deliver("a", 1)
        first.stop()

    first.call_soon(last_step)
    first.run_forever()
    registry.abort("a")  # the table empties ("b" is told with it)
    first.close()
    assert (a.rid, b.rid) == ("a", "b")
    assert registry.in_flight == 0
    assert told.rids == ["b", "a"]

    async def second_loop() -> None:
        told.changed = asyncio.Event()
        c = registry.open("c")
        d = registry.open("d")
        c.set_sink(lambda outputs: registry.abort(d.rid) or True)
        registry.deliver("c", 1)  # ends "d" inside the step: told soon after it
        async with asyncio.timeout(2):
            await told.changed.wait()
        assert told.rids == ["b", "a", "d"]
        await registry.close(drain_timeout=0)

    asyncio.run(second_loop())


def test_close_on_the_second_loop_does_not_wait_for_calls_of_a_loop_that_is_gone() -> None:
    told: list[str] = []

    async def on_abort(rid: str) -> None:
        told.append(rid)

    registry = tether.Registry(on_abort, abort_timeout=5.0)
    first = asyncio.new_event_loop()

    async def open_one() -> tether.Stream:
        return registry.open("a")

    a = first.run_until_complete(open_one())

    def last_step() -> None:
        registry.abort(a.rid)  # its on_abort's task is scheduled on the first loop
        first.stop()

    first.call_soon(last_step)
    first.run_forever()
    first.close()  # (the engine's loop, run by hand, closed without running it)

    async def second_loop() -> None:
        registry.open("b")
        async with asyncio.timeout(2):  # far below abort_timeout: nothing can run there
            await registry.close(drain_timeout=0)
        assert told == ["b"]

    asyncio.run(second_loop())
