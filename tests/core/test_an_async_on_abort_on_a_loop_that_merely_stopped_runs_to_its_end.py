"""An asynchronous ``on_abort`` under way on a loop that merely stopped (not closed:
``run_until_complete`` returned and will be called again) is not let go when the
registry opens on another loop: it runs to its end when its loop runs again, and its
rid stays held meanwhile (the producer has not taken the abort in: a new request
under that rid would get the old work's outputs). Only a closed loop's calls are
let go (``test_a_rid_is_not_held_by_an_on_abort_whose_loop_closed``)."""

from __future__ import annotations

import asyncio

import pytest

import tether


def test_an_async_on_abort_on_a_loop_that_merely_stopped_runs_to_its_end() -> None:
    gates: dict[str, asyncio.Event] = {}
    began: dict[str, asyncio.Event] = {}
    over: dict[str, asyncio.Event] = {}
    events: list[tuple[str, str]] = []

    async def on_abort(rid: str) -> None:
        events.append((rid, "began"))
        if rid in began:
            began[rid].set()
        try:
            if rid in gates:
                await gates[rid].wait()
        except BaseException as exc:
            events.append((rid, f"cut short by {type(exc).__name__}"))
            raise
        finally:
            if rid in over:
                over[rid].set()
        events.append((rid, "ended"))

    registry = tether.Registry(on_abort, abort_timeout=60)
    first = asyncio.new_event_loop()
    second = asyncio.new_event_loop()

    async def open_and_abort() -> None:
        gates["held"], began["held"], over["held"] = (asyncio.Event() for _ in range(3))
        registry.open("held")
        registry.abort("held")
        await began["held"].wait()

    async def move_and_reopen() -> None:
        registry.open("other").cancel()
        with pytest.raises(tether.DuplicateRequest):
            registry.open("held")  # its on_abort has not returned: still held

    async def finish() -> None:
        gates["held"].set()
        async with asyncio.timeout(5):  # (a bound, not a synchronisation: it ends or not)
            await over["held"].wait()

    try:
        first.run_until_complete(open_and_abort())  # stopped: the call is under way there
        second.run_until_complete(move_and_reopen())
        first.run_until_complete(finish())  # the first loop runs again
        assert [what for rid, what in events if rid == "held"] == ["began", "ended"]
    finally:
        first.close()
        second.close()
