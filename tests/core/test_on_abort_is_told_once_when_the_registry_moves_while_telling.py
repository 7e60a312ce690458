"""``on_abort(rid)`` is called exactly once (Invariant 3), even when the registry moves
to another loop while its old loop's queue is being told: a synchronous ``on_abort``
run with no loop running (a shutdown hook after the loop stopped) that ends another
request and then runs a fresh loop (``asyncio.run``) on which the registry is used
again. The waiting call goes with the registry to the new loop; the old queue must not
tell it a second time."""

from __future__ import annotations

import asyncio

import tether


def test_on_abort_is_told_once_when_the_registry_moves_while_telling() -> None:
    told: list[str] = []

    def on_abort(rid: str) -> None:
        told.append(rid)
        if rid == "first":
            registry.abort("second")  # told once this returns

            async def next_loop() -> None:
                registry.open("next").cancel()  # the registry moves to this loop

            asyncio.run(next_loop())

    registry = tether.Registry(on_abort)
    loop = asyncio.new_event_loop()

    async def open_two() -> list[tether.Stream]:
        return [registry.open("first"), registry.open("second")]

    try:
        streams = loop.run_until_complete(open_two())
        registry.abort("first")  # the loop's thread, the loop stopped
    finally:
        loop.close()
    assert sorted(told) == ["first", "next", "second"]
    assert [stream.rid for stream in streams] == ["first", "second"]
