"""A rid freed before its producer heard of the abort is *held* (it cannot be opened
again) until ``on_abort`` has taken it in; never longer. An asynchronous ``on_abort``
runs as a task owned by the registry: when that task is cancelled before its first
step (``asyncio.run`` cancels what is left when its main coroutine returns), the rid
must not stay held for ever, refused as "already in flight" with nothing in flight."""

from __future__ import annotations

import asyncio

import tether


def test_a_rid_whose_async_on_abort_task_never_started_can_be_opened_on_the_next_loop() -> None:
    told: list[str] = []

    async def on_abort(rid: str) -> None:
        told.append(rid)

    registry = tether.Registry(on_abort)

    async def last_step() -> None:
        first = registry.open("first")
        second = registry.open("second")
        # The sink ends "second" inside the producer's step: its on_abort is told soon.
        first.set_sink(lambda outputs: registry.abort("second") or True)
        registry.deliver("first", 1)
        registry.deliver("first", 2, finished=True)
        assert second.rid == "second"

    asyncio.run(last_step())
    assert registry.in_flight == 0

    async def next_loop() -> None:
        registry.open("second")  # nothing is in flight: the rid is free again

    asyncio.run(next_loop())
