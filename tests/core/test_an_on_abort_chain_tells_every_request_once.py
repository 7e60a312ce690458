"""``on_abort(rid)`` is called exactly once for every request closed before it finished
(Invariant 3), and ``on_abort`` may re-enter the registry: an ``on_abort`` that aborts
another request (a parent whose children go with it, each aborting the next) is a chain
as long as the requests are many, and every request it frees is told, once, whether the
chain began inside the producer's step or in a handler's ``abort()``."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter

import pytest

import tether

LENGTH = 2000


@pytest.mark.parametrize("where", ["handler", "producer-step"])
async def test_an_on_abort_that_aborts_the_next_request_tells_each_request_of_a_long_chain_once(
    where: str,
) -> None:
    told: Counter[str] = Counter()
    changed = asyncio.Event()

    def on_abort(rid: str) -> None:
        told[rid] += 1
        changed.set()
        following = after.get(rid)
        if following is not None:
            registry.abort(following)

    registry = tether.Registry(on_abort)
    chain = [registry.open() for _ in range(LENGTH)]
    after = {a.rid: b.rid for a, b in itertools.pairwise(chain)}
    if where == "handler":
        assert registry.abort(chain[0].rid)
    else:
        driver = registry.open()
        assert driver.set_sink(lambda outputs: (chain[0].cancel(), True)[1])
        registry.deliver(driver.rid, "x")
        registry.deliver(driver.rid, "y", finished=True)
    async with asyncio.timeout(10):  # (the chain runs whole within the first call)
        await changed.wait()
    freed = [stream.rid for stream in chain if stream.rid not in registry]
    assert [rid for rid in freed if told[rid] != 1] == [], "a freed request was never told"
    assert registry.in_flight == 0, "the chain stopped: requests left in flight"
