"""``on_abort`` never re-enters the producer in the middle of its step (Invariant 3's
callback, the table's rule since the producer's call defers it): that holds when one
producer serves two registries (say, one per endpoint family, each with its own
``max_in_flight``) and one HTTP request's scope holds a stream of each. The
producer's step into one registry is its step, whichever registry ends a request
inside it."""

from __future__ import annotations

import asyncio
from typing import Any

import tether


class Engine:
    """One producer behind two registries; ``on_abort`` must not run inside its step."""

    def __init__(self) -> None:
        self.in_step = 0
        self.inside: list[str] = []
        self.after: list[str] = []
        self.changed = asyncio.Event()

    def on_abort(self, rid: str) -> None:
        (self.inside if self.in_step else self.after).append(rid)
        self.changed.set()

    async def told(self, count: int) -> None:
        async with asyncio.timeout(10):
            while len(self.inside) + len(self.after) < count:
                self.changed.clear()
                await self.changed.wait()


async def test_a_scope_disconnected_in_one_registrys_step_defers_the_other_registrys_on_abort() -> (
    None
):
    engine = Engine()
    chat = tether.Registry(engine.on_abort)
    embeddings = tether.Registry(engine.on_abort)
    scope = tether.RequestScope()
    with scope:
        answer = chat.open()
        context = embeddings.open()

        def sink(outputs: list[Any]) -> bool:
            scope.disconnect()  # the transport is gone: the whole HTTP request is over
            return False

        assert answer.set_sink(sink)
        engine.in_step += 1
        try:
            chat.deliver_many([(answer.rid, "x", False)])  # the engine's step
        finally:
            engine.in_step -= 1
    await engine.told(2)
    assert engine.inside == [], "on_abort re-entered the producer inside its step"
    assert sorted(engine.after) == sorted([answer.rid, context.rid])
    assert chat.in_flight == embeddings.in_flight == 0
