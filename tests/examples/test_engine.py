"""The simulated batching engine: scheduling, aborts, failures, crashes, deterministic tokens."""

from __future__ import annotations

import asyncio

import pytest
from engine import (
    VOCAB,
    Engine,
    EngineUnavailable,
    SimulatedFailure,
    expected_text,
    merge_outputs,
    token_at,
)

import tether
import tether.http

from .conftest import eventually


def bound(engine: Engine, **options: object) -> tether.Registry:
    """A registry wired to ``engine`` as the example servers wire it, stepped by hand."""
    registry = tether.Registry(on_abort=engine.abort, merge=merge_outputs, **options)  # type: ignore[arg-type]
    engine.bind(registry)
    return registry


def test_tokens_are_a_function_of_prompt_and_position() -> None:
    tokens = [token_at("hello", position) for position in range(50)]
    assert tokens == [token_at("hello", position) for position in range(50)]
    assert all(token.startswith(" ") and token[1:] in VOCAB for token in tokens)
    assert len(set(tokens)) > 1
    assert [token_at("other", position) for position in range(50)] != tokens
    assert expected_text("hello", 50) == "".join(tokens)


async def test_each_request_finishes_at_its_own_length_and_frees_its_slot() -> None:
    engine = Engine(max_batch=4, step_interval=0.001)
    registry = tether.Registry(on_abort=engine.abort, merge=merge_outputs)
    async with engine.running(registry):
        lengths = {"a": 3, "bb": 7, "ccc": 12}
        streams = {prompt: registry.open() for prompt in lengths}
        for prompt, stream in streams.items():
            engine.submit(stream.rid, prompt, lengths[prompt])
        async with asyncio.timeout(10):
            results = {prompt: await stream.result() for prompt, stream in streams.items()}
    for prompt, result in results.items():
        assert result["text"] == expected_text(prompt, lengths[prompt])
        assert result["meta_info"]["completion_tokens"] == lengths[prompt]
        assert result["meta_info"]["finish_reason"] == "length"
    assert registry.in_flight == 0
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.finished) == (0, 0, 3)
    assert stats.tokens == sum(lengths.values())


async def test_streamed_outputs_carry_one_token_each_in_order() -> None:
    engine = Engine(max_batch=2)
    registry = bound(engine)
    stream = registry.open()
    engine.submit(stream.rid, "prompt", 5)
    seen = []
    for _ in range(5):
        engine.step()
        seen.extend(await stream.next_ready())
    assert [out["text"] for out in seen] == [token_at("prompt", i) for i in range(5)]
    assert [out["meta_info"]["completion_tokens"] for out in seen] == [1, 2, 3, 4, 5]
    assert await stream.next_ready() is None


async def test_running_batch_never_exceeds_max_batch() -> None:
    engine = Engine(max_batch=2)
    registry = bound(engine)
    batch = registry.open_batch(5)
    for rid in batch.rids:
        engine.submit(rid, rid, 2)
    engine.step()
    assert (engine.stats().running, engine.stats().waiting) == (2, 3)
    engine.step()  # the first two finish and free their slots
    engine.step()
    assert (engine.stats().running, engine.stats().waiting) == (2, 1)
    await batch.aclose()


async def test_abort_leaves_the_batch_at_the_next_step_and_its_slot_is_reused() -> None:
    engine = Engine(max_batch=1)
    registry = bound(engine)
    first, second = registry.open(), registry.open()
    engine.submit(first.rid, "first", 10)
    engine.submit(second.rid, "second", 10)
    engine.step()
    assert await first.next_ready() == [
        {"text": token_at("first", 0), "meta_info": {
            "id": first.rid, "finish_reason": None, "completion_tokens": 1}},
    ]  # fmt: skip
    await first.aclose()  # on_abort -> engine.abort, at once
    assert engine.stats().running == 1  # still holds its slot until the next step
    assert engine.recent_aborts()[-1][0] == first.rid
    engine.step()
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.aborted) == (1, 0, 1)
    assert stats.abort_to_free.count == 1
    assert [out["text"] for out in await second.next_ready()] == [token_at("second", 0)]
    assert registry.stats().late_outputs == 0
    await second.aclose()


async def test_abort_of_a_waiting_request_drops_it_at_once() -> None:
    engine = Engine(max_batch=1)
    registry = bound(engine)
    first, second = registry.open(), registry.open()
    engine.submit(first.rid, "first", 3)
    engine.submit(second.rid, "second", 3)
    await second.aclose()  # queued behind the first: never got a slot
    assert (engine.stats().waiting, engine.stats().aborted) == (1, 1)
    await first.aclose()
    engine.step()
    assert (engine.stats().running, registry.in_flight) == (0, 0)


async def test_failing_request_delivers_its_earlier_tokens_then_a_producer_error() -> None:
    engine = Engine(max_batch=8, step_interval=0.001, fail_fraction=1.0, seed=3)
    registry = tether.Registry(on_abort=engine.abort, merge=merge_outputs)
    async with engine.running(registry):
        stream = registry.open()
        engine.submit(stream.rid, "doomed", 20)
        texts: list[str] = []

        async def read_all() -> None:
            async for out in stream:
                texts.append(out["text"])

        async with asyncio.timeout(10):
            with pytest.raises(tether.ProducerError) as caught:
                await read_all()
    assert isinstance(caught.value.__cause__, SimulatedFailure)
    assert len(texts) < 20
    assert "".join(texts) == expected_text("doomed", len(texts))
    assert registry.in_flight == 0
    assert engine.stats().failed == registry.stats().failed == 1


async def test_fail_fraction_fails_about_that_share_of_requests() -> None:
    engine = Engine(max_batch=256, fail_fraction=0.25, seed=7)
    registry = bound(engine)
    streams = [registry.open() for _ in range(400)]
    for stream in streams:
        engine.submit(stream.rid, stream.rid, 4)
    for _ in range(10):  # two rounds of 4 tokens (256 slots, 400 requests)
        engine.step()
    failed = registry.stats().failed
    assert registry.in_flight == 0
    assert engine.stats().failed == failed
    assert 60 <= failed <= 140  # 100 expected; the seed makes it reproducible
    for stream in streams:
        await stream.aclose()


async def test_failed_sub_request_aborts_its_siblings_without_late_outputs() -> None:
    engine = Engine(max_batch=8, step_interval=0.001)
    registry = tether.Registry(on_abort=engine.abort, merge=merge_outputs)
    async with engine.running(registry):
        batch = registry.open_batch(3)
        for index, rid in enumerate(batch.rids):
            engine.submit(rid, rid, 50, fail_after=3 if index == 1 else None)
        async with asyncio.timeout(10):
            with pytest.raises(tether.ProducerError) as caught:
                await batch.result()
            assert isinstance(caught.value.__cause__, SimulatedFailure)
        await eventually(lambda: engine.stats().running == 0)  # siblings leave at the next step
    stats = registry.stats()
    assert (stats.in_flight, stats.late_outputs, stats.aborted_total) == (0, 0, 2)


async def test_crash_fails_every_request_in_flight_and_refuses_new_ones_until_recover() -> None:
    engine = Engine(max_batch=1)
    registry = bound(engine)
    running, waiting = registry.open(), registry.open()
    engine.submit(running.rid, "running", 10)
    engine.submit(waiting.rid, "waiting", 10)
    engine.step()
    engine.crash()
    engine.step()
    assert engine.crashed
    assert registry.in_flight == 0
    for stream in (running, waiting):
        with pytest.raises(tether.ProducerError) as caught:
            await stream.result()
        assert isinstance(caught.value.__cause__, EngineUnavailable)
    refused = registry.open()
    engine.submit(refused.rid, "refused", 3)
    with pytest.raises(tether.ProducerError) as caught:
        await refused.result()
    assert tether.http.error_response(caught.value).status == 503
    engine.recover()
    accepted = registry.open()
    engine.submit(accepted.rid, "accepted", 1)
    engine.step()
    assert (await accepted.result())["text"] == expected_text("accepted", 1)
    assert (engine.stats().running, engine.stats().waiting, registry.in_flight) == (0, 0, 0)


async def test_leaving_the_running_block_stops_the_scheduler() -> None:
    engine = Engine(step_interval=0.001)
    registry = tether.Registry(on_abort=engine.abort, merge=merge_outputs)
    async with engine.running(registry):
        stream = registry.open()
        engine.submit(stream.rid, "x", 1)
        async with asyncio.timeout(10):
            await stream.result()
        tasks = {task.get_name() for task in asyncio.all_tasks()}
        assert "engine-scheduler" in tasks
    assert "engine-scheduler" not in {task.get_name() for task in asyncio.all_tasks()}


class _BrokenStep(Engine):
    """An engine whose step raises an unexpected error, as a buggy real one might."""

    def step(self) -> None:
        raise RuntimeError("unexpected bug in the step")


async def test_an_unexpected_step_error_fails_every_request_instead_of_killing_the_loop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = _BrokenStep(max_batch=2, step_interval=0.001)
    registry = tether.Registry(on_abort=engine.abort, merge=merge_outputs)
    async with engine.running(registry):
        stream = registry.open()
        engine.submit(stream.rid, "hello", 5)
        async with asyncio.timeout(10):
            with pytest.raises(tether.ProducerError) as caught:
                await stream.result()
        assert isinstance(caught.value.__cause__, RuntimeError)
        assert engine.crashed
        late = registry.open()
        engine.submit(late.rid, "again", 3)
        with pytest.raises(tether.ProducerError):
            await late.result()
    assert registry.in_flight == 0
    assert "engine step failed" in caplog.text
