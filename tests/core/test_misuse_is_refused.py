"""Misuse at the boundaries of the core is refused at once with a typed error that
says what to do, and changes nothing: the registry used from a thread with no loop
(a sync FastAPI dependency runs in a thread pool), from a second event loop, or
from another thread than its loop's; a consumer read on another loop."""

from __future__ import annotations

import asyncio

import pytest

import tether

from .test_deliver_from_the_wrong_thread import BOUND, in_a_thread


def test_open_from_a_thread_with_no_loop_says_to_make_the_dependency_async() -> None:
    registry = tether.Registry()
    raised = in_a_thread(registry.open)
    assert isinstance(raised, tether.WrongLoop)
    assert isinstance(raised, tether.TetherError)
    assert "async def" in str(raised)
    assert "deliver_threadsafe" in str(raised)
    raised = in_a_thread(lambda: registry.open_batch(2))
    assert isinstance(raised, tether.WrongLoop)
    assert registry.in_flight == 0
    assert registry.stats().opened == 0


async def test_open_on_a_second_loop_while_requests_run_on_the_first_is_refused() -> None:
    registry = tether.Registry()
    stream = registry.open()

    async def open_there() -> None:
        registry.open()

    raised = in_a_thread(lambda: asyncio.run(open_there()))
    assert isinstance(raised, tether.WrongLoop)
    assert registry.in_flight == 1
    registry.deliver(stream.rid, "still here", finished=True)  # the first loop is still its own
    async with asyncio.timeout(BOUND):
        assert await stream.result() == "still here"


def test_a_registry_moves_to_a_new_loop_once_nothing_runs_on_the_old_one() -> None:
    registry = tether.Registry()

    async def one_request(text: str) -> object:
        stream = registry.open()
        registry.deliver(stream.rid, text, finished=True)
        return await stream.result()

    assert asyncio.run(one_request("first")) == "first"
    assert asyncio.run(one_request("second")) == "second"


@pytest.mark.parametrize("call", ["fail", "abort", "fail_all", "cancel"])
async def test_ending_a_request_from_another_thread_is_refused_and_changes_nothing(
    call: str,
) -> None:
    registry = tether.Registry()
    stream = registry.open()
    calls = {
        "fail": lambda: registry.fail(stream.rid, RuntimeError("x")),
        "abort": lambda: registry.abort(stream.rid),
        "fail_all": lambda: registry.fail_all(RuntimeError("x")),
        "cancel": stream.cancel,
    }
    raised = in_a_thread(calls[call])
    assert isinstance(raised, tether.WrongLoop)
    assert "threadsafe" in str(raised)
    assert stream.rid in registry
    registry.deliver(stream.rid, "out", finished=True)
    async with asyncio.timeout(BOUND):
        assert await stream.result() == "out"


async def test_reading_a_stream_on_another_loop_is_refused() -> None:
    registry = tether.Registry()
    stream = registry.open()

    async def read_there() -> None:
        await stream.result()

    raised = in_a_thread(lambda: asyncio.run(read_there()))
    assert isinstance(raised, tether.WrongLoop)
    registry.deliver(stream.rid, "out", finished=True)
    async with asyncio.timeout(BOUND):
        assert await stream.result() == "out"


def test_handing_over_to_a_closed_loop_is_a_typed_error() -> None:
    registry = tether.Registry()

    async def open_one() -> str:
        stream = registry.open()
        await stream.aclose()
        return stream.rid

    rid = asyncio.run(open_one())
    with pytest.raises(tether.WrongLoop, match="closed"):
        registry.deliver_threadsafe(rid, "late")
