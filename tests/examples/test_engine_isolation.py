"""One request's failure in the engine stays its own: its batch-mates and the engine go on."""

from __future__ import annotations

import asyncio

import pytest
from engine import Engine, expected_text, merge_outputs

import tether

UNENCODABLE = "bad \ud800 prompt"  # a lone surrogate: token_at cannot encode it


def bound(engine: Engine) -> tether.Registry:
    registry = tether.Registry(on_abort=engine.abort, merge=merge_outputs)
    engine.bind(registry)
    return registry


async def test_a_request_whose_token_cannot_be_computed_fails_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = Engine(max_batch=8)
    registry = bound(engine)
    before, bad, after = registry.open(), registry.open(), registry.open()
    engine.submit(before.rid, "before", 3)
    engine.submit(bad.rid, UNENCODABLE, 3)
    engine.submit(after.rid, "after", 3)
    engine.step()
    with pytest.raises(tether.ProducerError) as caught:
        await bad.result()
    assert isinstance(caught.value.__cause__, UnicodeEncodeError)
    assert bad.rid in caplog.text  # logged for the operator, with the rid
    assert not engine.crashed
    stats = engine.stats()  # the same step delivered the others' first tokens
    assert (stats.running, stats.failed, stats.tokens) == (2, 1, 2)
    engine.step()
    engine.step()
    assert (await before.result())["text"] == expected_text("before", 3)
    assert (await after.result())["text"] == expected_text("after", 3)
    assert registry.in_flight == 0


async def test_a_failing_sub_request_fails_its_batch_but_not_the_engine() -> None:
    engine = Engine(max_batch=8, step_interval=0.001)
    registry = tether.Registry(on_abort=engine.abort, merge=merge_outputs)
    async with engine.running(registry):
        bystander = registry.open()
        engine.submit(bystander.rid, "bystander", 20)
        batch = registry.open_batch(2)
        engine.submit(batch.rids[0], "fine", 20)
        engine.submit(batch.rids[1], UNENCODABLE, 20)
        async with asyncio.timeout(10):
            with pytest.raises(tether.ProducerError):
                await batch.result()
            assert (await bystander.result())["text"] == expected_text("bystander", 20)
            assert not engine.crashed
            later = registry.open()
            engine.submit(later.rid, "later", 2)
            assert (await later.result())["text"] == expected_text("later", 2)
    assert registry.in_flight == 0
    assert engine.stats().failed == 1


async def test_crash_still_fails_every_request_in_flight() -> None:
    engine = Engine(max_batch=8)
    registry = bound(engine)
    streams = [registry.open() for _ in range(3)]
    for stream in streams:
        engine.submit(stream.rid, stream.rid, 5)
    engine.step()
    engine.crash()
    engine.step()
    assert engine.crashed
    for stream in streams:
        with pytest.raises(tether.ProducerError):
            await stream.result()
    assert registry.in_flight == 0
