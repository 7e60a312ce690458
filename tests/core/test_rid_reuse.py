"""A rid is never open again before its producer has heard it was aborted.

``Table`` frees an aborted entry at once but, on the paths entered from the
producer (a batch sibling aborted because ``fail()`` ended another sub-request, a
``merge`` that raised, a consumer too slow, a consumer dropped without being
closed), tells the producer later (``defer``: ``call_soon(on_abort)``). In between,
``open(rid)`` accepts the same id for a new request (a client retrying with its
own id, or any client that read the id in a response). When ``on_abort(rid)``
finally runs, the producer, which knows requests only by their id, aborts the
newcomer; the old work goes on and its outputs go to the newcomer: one client's
output sent to another. So a rid freed but not yet reported is refused
(``DuplicateRequest``) until ``on_abort`` has run, and fresh ids skip it.
"""

from __future__ import annotations

import asyncio

import pytest

import tether
from tests._support.engine import Engine, expected_text, merge_outputs, tokens


async def test_on_abort_never_names_a_rid_that_is_live_again() -> None:
    live_when_told: list[bool] = []
    told = asyncio.Event()

    def on_abort(rid: str) -> None:
        live_when_told.append(rid in registry)
        told.set()

    registry = tether.Registry(on_abort)
    batch = registry.open_batch(["s1", "s2"])
    registry.fail("s1", RuntimeError("the engine failed s1"))  # s2: aborted, told later
    with pytest.raises(tether.DuplicateRequest):
        registry.open("s2")  # a client retrying in the same turn of the loop: not yet
    async with asyncio.timeout(10):
        await told.wait()
    assert live_when_told == [False], "the producer was told to abort 's2' while 's2' was live"
    retry = registry.open("s2")  # once the producer knows, the id is free again
    await retry.aclose()
    await batch.aclose()


async def test_a_retry_under_a_freed_rid_gets_its_own_tokens_from_the_engine() -> None:
    told = asyncio.Event()

    def on_abort(rid: str) -> None:
        engine.abort(rid)
        told.set()

    registry = tether.Registry(on_abort, merge=merge_outputs)
    engine = Engine(registry)
    failed, more = asyncio.Event(), asyncio.Event()
    batch = registry.open_batch(["s1", "s2"])
    # s1 fails at its third token (telling the test in that same engine step): s2 is
    # aborted as its sibling while its job still has tokens to give.
    engine.submit("s1", [*tokens("first prompt", 2), failed.set, RuntimeError("s1 broke")])
    engine.submit("s2", [*tokens("second prompt", 2), more, *tokens("second prompt", 18)])
    try:
        async with asyncio.timeout(10):
            await failed.wait()
        assert "s2" not in registry
        # A client whose request died with the batch retries at once, under its own id:
        # refused until the engine heard of the abort, then its own.
        with pytest.raises(tether.DuplicateRequest):
            registry.open("s2")
        async with asyncio.timeout(10):
            await told.wait()  # the deferred on_abort('s2') ran: the engine dropped the old job
            retry = registry.open("s2")
            engine.submit(retry, tokens("retry prompt", 3))
            more.set()  # an old job that still ran would deliver into the retry now
            result = await retry.result()
        assert result["text"] == expected_text("retry prompt", 3), (
            f"the retry got another request's text: {result['text']!r}"
        )
    finally:
        await engine.stop()
        await batch.aclose()
