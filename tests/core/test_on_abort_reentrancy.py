"""An ``on_abort`` may re-enter the registry for *other* rids of the same batch.

The registry promises that ``on_abort`` may re-enter it ("on_abort runs after the
entry is freed"), for the rid being reported and for the others: closing a batch
calls ``on_abort`` while it walks the batch's states, and a callback that ends one
of those (an engine aborting a whole sequence group, or answering an abort with
the final output of a sibling) must not make the walk release it twice.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import tether

REENTRANT = (
    "Table._close calls a synchronous on_abort mid-loop and then releases states it "
    "listed as live before the call: KeyError from del entries[rid]"
)


async def test_closing_a_batch_survives_an_on_abort_that_aborts_its_siblings() -> None:
    calls: Counter[str] = Counter()

    def on_abort(rid: str) -> None:
        # An engine that aborts a request's whole group when one member is aborted.
        calls[rid] += 1
        for other in batch.rids:
            registry.abort(other)

    registry = tether.Registry(on_abort)
    batch = registry.open_batch(3)
    await batch.aclose()
    assert registry.in_flight == 0
    assert calls == dict.fromkeys(batch.rids, 1)


async def test_registry_close_aborts_everything_even_when_on_abort_reenters() -> None:
    calls: Counter[str] = Counter()
    groups: dict[str, tuple[str, ...]] = {}

    def on_abort(rid: str) -> None:
        calls[rid] += 1
        for other in groups[rid]:
            registry.abort(other)

    registry = tether.Registry(on_abort)
    batch = registry.open_batch(2)
    bystander = registry.open()
    for rid in batch.rids:
        groups[rid] = batch.rids
    groups[bystander.rid] = ()
    async with asyncio.timeout(10):
        await registry.close(drain_timeout=0)
    # ...and what it had not reached yet does not stay in flight
    assert registry.in_flight == 0
    assert bystander.finished
    assert calls == {**dict.fromkeys(batch.rids, 1), bystander.rid: 1}
    await bystander.aclose()


async def test_cancelling_a_batch_survives_an_on_abort_that_finishes_a_sibling() -> None:
    def on_abort(rid: str) -> None:
        # An engine whose abort flushes the last output of the other sub-requests.
        for other in batch.rids:
            registry.deliver(other, "flushed", finished=True)

    registry = tether.Registry(on_abort)
    batch = registry.open_batch(2)
    batch.cancel()
    assert registry.in_flight == 0


async def test_a_request_opened_from_on_abort_keeps_its_table_entry() -> None:
    opened: list[tether.Stream] = []
    refused: list[str] = []

    def on_abort(rid: str) -> None:
        if rid == "a" and not opened:
            registry.abort("b")  # (already ended with its batch: late)
            opened.append(registry.open("c"))  # a new request, opened from on_abort ...
            try:
                registry.open("b")  # ... but not the sibling's id, whose abort is untold
            except tether.DuplicateRequest:
                refused.append("b")

    registry = tether.Registry(on_abort)
    batch = registry.open_batch(["a", "b"])
    batch.cancel()
    assert refused == ["b"], "a rid was reopened before its producer was told of its abort"
    (new,) = opened
    retry = registry.open("b")  # (told now: a retry takes the freed id)
    try:
        assert "c" in registry, "the request opened from on_abort lost its entry"
        assert registry.deliver("c", 1, finished=True)
        assert registry.deliver("b", 2, finished=True)
        async with asyncio.timeout(10):
            assert await new.result() == 1
            assert await retry.result() == 2
    finally:
        await new.aclose()
        await retry.aclose()
