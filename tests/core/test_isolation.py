"""One request can never reach another's state: ids, hostile ids, and a merge that raises."""

from __future__ import annotations

import asyncio
import gc
import sys
import warnings
from typing import Any

import pytest

import tether
import tether.http

from .conftest import AbortLog


def _auto_shaped(rid: str, ahead: int) -> str:
    prefix, number = rid.rsplit("-", 1)
    return f"{prefix}-{int(number) + ahead}"


async def test_auto_rid_never_takes_a_live_client_chosen_rid(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    seen = registry.open()
    # A client reads the prefix off any rid and claims the next fresh ids.
    claimed = [registry.open(_auto_shaped(seen.rid, ahead)) for ahead in (1, 2, 3)]
    fresh = registry.open()
    batch = registry.open_batch(2)
    rids = [seen.rid, *(stream.rid for stream in claimed), fresh.rid, *batch.rids]
    assert len(set(rids)) == len(rids) == registry.in_flight
    # Each request still gets exactly its own outputs, and each ends on its own.
    for rid in rids:
        registry.deliver(rid, f"for {rid}", finished=True)
    for stream in (seen, *claimed, fresh):
        assert await stream.result() == f"for {stream.rid}"
    assert await batch.result() == [f"for {rid}" for rid in batch.rids]
    assert registry.in_flight == 0
    assert not aborts.calls


async def test_closing_a_request_whose_rid_a_client_chose_like_an_auto_id_frees_it_once(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    first = registry.open()
    chosen = registry.open(_auto_shaped(first.rid, 1))
    auto = registry.open()
    await chosen.aclose()
    await auto.aclose()
    await first.aclose()
    assert registry.in_flight == 0
    assert aborts.calls == dict.fromkeys((first.rid, chosen.rid, auto.rid), 1)
    async with asyncio.timeout(10):
        await registry.close(drain_timeout=1)  # nothing left to wait for


@pytest.mark.parametrize(
    "rid",
    [
        pytest.param("", id="empty"),
        pytest.param("\ud800", id="lone-surrogate"),
        pytest.param("a\udfffb", id="surrogate-inside"),
        pytest.param("line\nbreak", id="newline"),
        pytest.param("nul\x00", id="nul"),
        pytest.param("esc\x1b[31m", id="escape"),
        pytest.param("x" * (getattr(tether, "MAX_RID_LENGTH", 256) + 1), id="too-long"),
        pytest.param(7, id="not-a-str"),
    ],
)
async def test_an_invalid_client_rid_is_refused_and_nothing_is_registered(
    registry: tether.Registry, rid: Any
) -> None:
    with pytest.raises(tether.InvalidRequestId) as caught:
        registry.open(rid)
    assert isinstance(caught.value, ValueError)
    with pytest.raises(tether.InvalidRequestId):
        registry.open_batch(["fine", rid])
    assert registry.in_flight == 0
    assert registry.stats().opened == 0
    assert tether.http.error_response(caught.value).status == 422


async def test_valid_client_rids_of_any_script_are_accepted(registry: tether.Registry) -> None:
    longest = "x" * getattr(tether, "MAX_RID_LENGTH", 256)
    rids = ["req-1", "日本語", "emoji-🙂", "with space", longest]
    streams = [registry.open(rid) for rid in rids]
    assert [stream.rid for stream in streams] == rids
    for stream in streams:
        await stream.aclose()


def _raising_merge(older: Any, newer: Any) -> Any:
    if newer == "poison":
        raise TypeError("merge cannot fold this")
    return older + newer


async def test_a_raising_merge_fails_that_request_alone_and_never_reaches_the_producer(
    aborts: AbortLog,
) -> None:
    registry = tether.Registry(aborts, merge=_raising_merge)
    victim, bystander = registry.open(), registry.open()
    registry.deliver(victim.rid, "a")
    step = [(victim.rid, "poison", False), (bystander.rid, "done", True)]
    assert registry.deliver_many(step) == 2  # no exception, and the rest of the step landed
    assert await bystander.result() == "done"
    with pytest.raises(tether.ProducerError) as caught:
        await victim.result()
    assert isinstance(caught.value.__cause__, TypeError)
    assert registry.in_flight == 0
    await aborts.wait_for(1)
    assert aborts.calls == {victim.rid: 1}  # the producer did not know: it is told to stop
    assert registry.stats().failed == 1


@pytest.mark.parametrize("finished", [False, True], ids=["mid-stream", "last-output"])
async def test_a_raising_merge_in_collect_mode_and_in_a_batch_fails_cleanly(
    aborts: AbortLog, finished: bool
) -> None:
    registry = tether.Registry(aborts, merge=_raising_merge)
    stream = registry.open()
    collecting = asyncio.ensure_future(stream.result())
    registry.deliver(stream.rid, "a")
    await asyncio.sleep(0)  # let result() park in collect mode (a yield, not a timing)
    registry.deliver(stream.rid, "poison", finished=finished)
    with pytest.raises(tether.ProducerError):
        async with asyncio.timeout(10):
            await collecting
    batch = registry.open_batch(2)
    registry.deliver(batch.rids[0], "a")
    registry.deliver(batch.rids[0], "poison", finished=finished)  # folded in the shared list
    with pytest.raises(tether.ProducerError):
        await batch.result()
    assert registry.in_flight == 0
    expected = {batch.rids[1]} if finished else {stream.rid, *batch.rids}
    await aborts.wait_for(len(expected))
    assert set(aborts.calls) == expected
    assert set(aborts.calls.values()) == {1}


async def test_a_dropped_consumer_of_a_reused_auto_shaped_rid_raises_nothing_unraisable(
    registry: tether.Registry,
) -> None:
    caught: list[Any] = []
    old_hook = sys.unraisablehook
    sys.unraisablehook = caught.append
    try:
        first = registry.open()
        chosen = registry.open(_auto_shaped(first.rid, 1))
        auto = registry.open()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            del chosen, auto  # dropped without being closed: __del__ aborts them
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()
        await asyncio.sleep(0)  # deferred on_abort calls run (a yield, not a timing)
    finally:
        sys.unraisablehook = old_hook
    assert caught == []
    await first.aclose()
    assert registry.in_flight == 0


async def test_a_raising_merge_of_outputs_a_reader_left_unread_fails_that_request_alone(
    aborts: AbortLog,
) -> None:
    """``result()`` folds what an ``async for`` took but did not hand out with what came
    after it: a ``merge`` that raises there fails that sub-request as it would have in
    the producer's ``deliver()`` (nothing lost silently, nothing left live)."""
    registry = tether.Registry(aborts, merge=_raising_merge)
    batch = registry.open_batch(2)
    registry.deliver(batch.rids[0], "a")
    registry.deliver(batch.rids[1], "b")
    async for pair in batch:  # takes both, hands out the first
        assert pair == (0, "a")
        break
    registry.deliver(batch.rids[1], "poison")  # folded with the unread "b" by result()
    with pytest.raises(tether.ProducerError) as caught:
        async with asyncio.timeout(10):
            await batch.result()
    assert isinstance(caught.value.__cause__, TypeError)
    assert registry.in_flight == 0
    await aborts.wait_for(2)
    assert set(aborts.calls) == set(batch.rids)  # the producer is told to stop both
    assert registry.stats().failed >= 1
