"""Registry: admission, request ids, late producer calls and the stats snapshot."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable

import pytest

import tether
import tether.http

from .conftest import AbortLog


async def test_open_gives_fresh_unique_rids(registry: tether.Registry) -> None:
    streams = [registry.open() for _ in range(100)]
    assert len({stream.rid for stream in streams}) == 100
    assert registry.in_flight == 100
    for stream in streams:
        await stream.aclose()


async def test_open_with_a_live_rid_raises_duplicate_request_and_keeps_the_first(
    registry: tether.Registry,
) -> None:
    first = registry.open("req-1")
    with pytest.raises(tether.DuplicateRequest, match="req-1") as caught:
        registry.open("req-1")
    assert caught.value.rid == "req-1"
    assert isinstance(caught.value, KeyError)
    registry.deliver("req-1", "out", finished=True)
    assert await first.result() == "out"
    again = registry.open("req-1")  # a finished rid can be used again
    await again.aclose()


async def test_open_beyond_max_in_flight_raises_overloaded(aborts: AbortLog) -> None:
    registry = tether.Registry(aborts, max_in_flight=2)
    first, second = registry.open(), registry.open()
    with pytest.raises(tether.Overloaded) as caught:
        registry.open()
    assert caught.value.limit == 2
    with pytest.raises(tether.Overloaded):
        registry.open_batch(1)
    await first.aclose()
    third = registry.open()  # room again once one is closed
    assert registry.in_flight == 2
    await second.aclose()
    await third.aclose()


async def test_open_after_close_raises_registry_closed(registry: tether.Registry) -> None:
    await registry.close()
    with pytest.raises(tether.RegistryClosed):
        registry.open()
    with pytest.raises(tether.RegistryClosed):
        registry.open_batch(2)
    assert registry.stats().closed


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"max_in_flight": 0}, "max_in_flight", id="max_in_flight-zero"),
        pytest.param({"max_pending": 0}, "max_pending", id="max_pending-zero"),
    ],
)
def test_registry_rejects_nonsensical_limits(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tether.Registry(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("timeout", [0, -1.0], ids=["zero", "negative"])
async def test_open_rejects_a_non_positive_timeout(
    registry: tether.Registry, timeout: float
) -> None:
    with pytest.raises(ValueError, match="timeout"):
        registry.open(timeout=timeout)
    assert registry.in_flight == 0


async def test_late_outputs_fails_and_aborts_are_counted_not_raised(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    stream = registry.open()
    registry.deliver(stream.rid, "done", finished=True)
    assert registry.deliver(stream.rid, "late") is False
    assert registry.fail(stream.rid, RuntimeError("late")) is False
    assert registry.abort(stream.rid) is False
    assert registry.abort("never-opened") is False
    assert registry.stats().late_outputs == 4
    assert not aborts.calls  # an abort after finish calls nothing
    assert await stream.result() == "done"


async def test_dispatch_failure_after_open_in_a_request_scope_leaves_nothing_behind(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    def dispatch(rid: str) -> None:
        raise ValueError(f"cannot tokenise the prompt of {rid}")

    opened: list[str] = []

    def handler() -> None:
        with tether.RequestScope():
            stream = registry.open()
            opened.append(stream.rid)
            dispatch(stream.rid)

    with pytest.raises(ValueError, match="tokenise"):
        handler()
    assert registry.in_flight == 0
    assert aborts.calls == dict.fromkeys(opened, 1)
    assert registry.deliver(opened[0], "too late") is False


async def test_fail_all_fails_every_request_in_flight(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    stream = registry.open()
    batch = registry.open_batch(2, keep_going=True)
    crash = RuntimeError("engine crashed")
    assert registry.fail_all(crash) == 3
    assert registry.in_flight == 0
    with pytest.raises(tether.ProducerError):
        await stream.result()
    results = await batch.result()
    assert all(isinstance(r, tether.ProducerError) and r.__cause__ is crash for r in results)
    assert not aborts.calls


async def test_stats_is_a_frozen_snapshot_of_every_figure(registry: tether.Registry) -> None:
    finished, failed, aborted, timed = (registry.open() for _ in range(4))
    live = registry.open()
    registry.deliver(finished.rid, 1, finished=True)
    registry.deliver(failed.rid, 1)
    registry.fail(failed.rid, RuntimeError("boom"))
    registry.abort(aborted.rid)
    timed.cancel(tether.AbortReason.TIMEOUT)
    registry.deliver(finished.rid, "late")

    stats = registry.stats()
    assert stats.opened == 5
    assert stats.finished == 1
    assert stats.failed == 1
    assert stats.aborted == {"server": 1, "timeout": 1}
    assert stats.aborted_total == 2
    assert stats.late_outputs == 1
    assert stats.in_flight == 1
    assert stats.max_in_flight is None
    assert not stats.closed
    assert stats.time_to_first_output.count == 2  # finished and failed got outputs
    assert stats.total_time.count == 4  # every request that ended
    assert 0 <= stats.total_time.p50 <= stats.total_time.p99 <= stats.total_time.max
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.opened = 0  # type: ignore[misc]
    json.dumps(stats.as_dict())  # JSON-ready for a metrics endpoint

    await live.aclose()
    assert stats.in_flight == 1  # a snapshot: later events do not change it
    assert registry.stats().in_flight == 0
    for stream in (finished, failed, aborted, timed):
        await stream.aclose()


async def _succeed(registry: tether.Registry, stream: tether.Stream) -> None:
    registry.deliver(stream.rid, "ok", finished=True)
    await stream.result()


async def _producer_error(registry: tether.Registry, stream: tether.Stream) -> None:
    registry.fail(stream.rid, RuntimeError("engine error"))
    with pytest.raises(tether.ProducerError):
        await stream.result()


async def _dispatch_error(registry: tether.Registry, stream: tether.Stream) -> None:
    raise ValueError("could not hand the request to the engine")


async def _timeout(registry: tether.Registry, stream: tether.Stream) -> None:
    with pytest.raises(tether.RequestTimeout):
        await stream.result()


async def _cancellation(registry: tether.Registry, stream: tether.Stream) -> None:
    task = asyncio.ensure_future(stream.result())
    registry.deliver(stream.rid, "partial")
    await asyncio.wait([task], timeout=0)  # may or may not have started: both must be clean
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def _client_disconnect(registry: tether.Registry, stream: tether.Stream) -> None:
    scope = tether.http.current_scope()
    assert scope is not None
    scope.disconnect()
    with pytest.raises(tether.Aborted):
        await stream.result()


async def _shutdown(registry: tether.Registry, stream: tether.Stream) -> None:
    await registry.close(drain_timeout=0.01)
    with pytest.raises(tether.Aborted):
        await stream.result()


@pytest.mark.parametrize(
    "path",
    [
        _succeed,
        _producer_error,
        _dispatch_error,
        _timeout,
        _cancellation,
        _client_disconnect,
        _shutdown,
    ],
    ids=lambda path: path.__name__.strip("_"),
)
async def test_no_path_leaves_an_entry_behind_once_the_handler_returned(
    registry: tether.Registry,
    aborts: AbortLog,
    path: Callable[[tether.Registry, tether.Stream], Awaitable[None]],
) -> None:
    async def handler() -> None:
        with tether.RequestScope():
            stream = registry.open(timeout=0.05)
            await path(registry, stream)

    try:
        async with asyncio.timeout(10):
            await handler()
    except ValueError:
        assert path is _dispatch_error
    assert registry.in_flight == 0
    stats = registry.stats()
    assert stats.finished + stats.failed + stats.aborted_total == stats.opened == 1
    assert aborts.calls.total() == stats.aborted_total


async def test_closed_registry_reports_closed_before_a_duplicate_batch_id() -> None:
    registry = tether.Registry()
    stream = registry.open("taken")
    await registry.close(drain_timeout=0)
    with pytest.raises(tether.RegistryClosed):
        registry.open_batch(["taken", "free"])
    assert stream.finished


async def test_reading_an_aborted_stream_twice_does_not_grow_the_traceback() -> None:
    registry = tether.Registry()
    stream = registry.open()
    stream.cancel(tether.AbortReason.SERVER)
    depths = []
    for _ in range(3):
        with pytest.raises(tether.Aborted) as caught:
            await stream.__anext__()
        depth, tb = 0, caught.value.__traceback__
        while tb is not None:
            depth, tb = depth + 1, tb.tb_next
        depths.append(depth)
    assert depths[0] == depths[1] == depths[2]
