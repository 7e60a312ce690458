"""A rid is held only while its ``on_abort`` can still run (Invariant 2, 13): an
asynchronous ``on_abort`` left pending on a loop that stopped, then closed after the
registry had moved on to another loop, can never finish; its rid must not stay
taken for ever (``DuplicateRequest`` with nothing in flight)."""

from __future__ import annotations

import asyncio

import tether


def test_a_rid_is_not_held_by_an_on_abort_whose_loop_closed_after_the_move() -> None:
    async def on_abort(rid: str) -> None:
        if rid == "held":
            await asyncio.Event().wait()  # (its loop stops before it could finish)

    registry = tether.Registry(on_abort, abort_timeout=60)
    first = asyncio.new_event_loop()

    async def open_and_abort() -> None:
        registry.open("held")
        registry.abort("held")

    first.run_until_complete(open_and_abort())  # stopped: the call is under way there

    async def move() -> None:
        registry.open("other").cancel()

    second = asyncio.new_event_loop()
    try:
        second.run_until_complete(move())  # the first loop merely stopped: kept
        first.close()  # now it never runs again

        async def reopen() -> int:
            stream = registry.open("held")
            stream.cancel()
            return registry.in_flight

        assert second.run_until_complete(reopen()) == 0
    finally:
        second.close()
