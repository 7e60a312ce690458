"""A stream's sink: outputs handed over inside the producer's deliver(), with the
reading task woken only for the end, an error, or a sink that declines."""

from __future__ import annotations

import asyncio
import operator
from typing import Any

import pytest

import tether

from .conftest import AbortLog


class Sink:
    """Records what it is handed; declines (or raises) from a chosen call on."""

    def __init__(self, *, decline_at: int | None = None, raise_at: int | None = None) -> None:
        self.calls: list[list[Any]] = []
        self.decline_at = decline_at
        self.raise_at = raise_at

    def __call__(self, outputs: list[Any]) -> bool:
        n = len(self.calls)
        if n == self.raise_at:
            raise OSError("transport gone")
        if n == self.decline_at:
            return False
        self.calls.append(list(outputs))
        return True


class DeliversInside:
    """A sink that, offered its first output, delivers ``inner`` to its own stream (each
    one offered to it from inside itself, and declined), then declines or raises."""

    def __init__(self, registry: tether.Registry, rid: str, inner: list[Any], outer: str) -> None:
        self.registry = registry
        self.rid = rid
        self.inner = inner
        self.outer = outer
        self.offered: list[list[Any]] = []

    def __call__(self, outputs: list[Any]) -> bool:
        self.offered.append(list(outputs))
        if len(self.offered) == 1:
            for output in self.inner:
                self.registry.deliver(self.rid, output)
            if self.outer == "raises":
                raise OSError("transport gone")
        return False


async def test_a_sink_gets_each_output_in_the_producers_step_without_waking_the_reader(
    aborts: AbortLog,
) -> None:
    registry = tether.Registry(aborts)
    async with registry.open() as stream:
        sink = Sink()
        assert stream.set_sink(sink)
        reader = asyncio.create_task(stream.wait_ready())
        await asyncio.sleep(0)  # the reader parks
        for token in ("a", "b", "c"):
            registry.deliver(stream.rid, token)
            assert sink.calls[-1] == [token]  # handed over inside deliver()
        assert not reader.done()  # nobody was woken for them
        registry.deliver(stream.rid, "end", finished=True)
        await asyncio.wait_for(reader, 10)  # the end wakes the reader
        assert sink.calls == [["a"], ["b"], ["c"]]
        # the last output waits for the reader, with the end: one write for both
        assert stream.ready() == ["end"]
        assert stream.ready() is None
    assert not aborts.calls
    assert registry.stats().in_flight == 0


async def test_a_sink_that_declines_leaves_the_outputs_to_the_reader_in_order(
    aborts: AbortLog,
) -> None:
    registry = tether.Registry(aborts)
    async with registry.open() as stream:
        sink = Sink(decline_at=1)
        assert stream.set_sink(sink)
        reader = asyncio.create_task(stream.wait_ready())
        await asyncio.sleep(0)
        registry.deliver(stream.rid, 1)
        registry.deliver(stream.rid, 2)  # declined: the reader is woken
        registry.deliver(stream.rid, 3)  # the sink is gone: this one waits too
        await asyncio.wait_for(reader, 10)
        assert sink.calls == [[1]]
        assert stream.ready() == [2, 3]


async def test_a_sink_that_raises_loses_nothing_and_the_producer_goes_on(
    aborts: AbortLog,
) -> None:
    registry = tether.Registry(aborts, merge=operator.add)
    async with registry.open() as stream:
        assert stream.set_sink(Sink(raise_at=0))
        reader = asyncio.create_task(stream.wait_ready())
        await asyncio.sleep(0)
        assert registry.deliver(stream.rid, 1) is True  # nothing raised into the producer
        registry.deliver(stream.rid, 2)
        await asyncio.wait_for(reader, 10)
        assert stream.ready() == [3]  # the declined output, merged with the next
        registry.deliver(stream.rid, 4, finished=True)
        assert stream.ready() == [4]
    assert not aborts.calls


async def test_an_abort_or_a_failure_wakes_the_reader_not_the_sink(aborts: AbortLog) -> None:
    registry = tether.Registry(aborts)
    aborted, failed = registry.open(), registry.open()
    sinks = [Sink(), Sink()]
    readers = []
    for stream, sink in zip((aborted, failed), sinks, strict=True):
        assert stream.set_sink(sink)
        readers.append(asyncio.create_task(stream.wait_ready()))
    await asyncio.sleep(0)
    registry.abort(aborted.rid)
    registry.fail(failed.rid, ValueError("engine"))
    await asyncio.wait_for(asyncio.gather(*readers), 10)
    assert sinks[0].calls == sinks[1].calls == []
    with pytest.raises(tether.Aborted):
        aborted.ready()
    with pytest.raises(tether.ProducerError):
        failed.ready()
    await aborted.aclose()
    await failed.aclose()
    assert aborts.rids == {aborted.rid}


async def test_a_sink_is_refused_while_outputs_wait_and_for_a_batch_read_whole(
    aborts: AbortLog,
) -> None:
    registry = tether.Registry(aborts)
    async with registry.open() as stream:
        registry.deliver(stream.rid, "waiting")
        assert not stream.set_sink(Sink())  # read what waits first: bytes keep their order
        assert stream.ready() == ["waiting"]
        assert stream.set_sink(Sink())
        assert not stream.set_sink(None)  # removed
        registry.deliver(stream.rid, "read the usual way")
        assert stream.ready() == ["read the usual way"]
    async with registry.open_batch(2) as batch:
        assert not batch.set_sink(Sink())
    ended = registry.open()
    registry.deliver(ended.rid, "last", finished=True)
    assert not ended.set_sink(Sink())
    await ended.aclose()


@pytest.mark.parametrize("merge", [None, operator.add], ids=["appended", "merged"])
@pytest.mark.parametrize("outer", ["declines", "raises"])
async def test_an_output_delivered_from_inside_a_declining_sink_waits_after_the_declined_one(
    aborts: AbortLog, outer: str, merge: Any
) -> None:
    """A sink whose call delivers to its own stream (a send chain that delivers, say),
    then declines or raises: both outputs stay readable, the declined one first."""
    registry = tether.Registry(aborts, merge=merge)
    async with registry.open() as stream:
        calls: list[list[Any]] = []

        def sink(outputs: list[Any]) -> bool:
            calls.append(list(outputs))
            if len(calls) == 1:
                registry.deliver(stream.rid, "inner")  # offered to this sink, declined
                if outer == "raises":
                    raise RuntimeError("the sink broke")
            return False

        reader = asyncio.create_task(stream.wait_ready(timeout=10))
        await asyncio.sleep(0)  # the reader parks
        assert stream.set_sink(sink)
        assert registry.deliver(stream.rid, "outer") is True
        await asyncio.wait_for(reader, 10)
        assert calls == [["outer"], ["inner"]]
        assert stream.ready() == (["outer", "inner"] if merge is None else ["outerinner"])
        registry.deliver(stream.rid, "end", finished=True)
        assert stream.ready() == ["end"]
    assert not aborts.calls


@pytest.mark.parametrize("outer", ["declines", "raises"])
async def test_what_a_declining_sink_leaves_waiting_is_bounded_by_max_pending(
    aborts: AbortLog, outer: str
) -> None:
    """The declined output and those delivered from inside the sink wait together, and
    together they may not outnumber ``max_pending``: one more ends the request as too
    slow, as any backlog over the bound does."""
    registry = tether.Registry(aborts, max_pending=4)
    fits, over = registry.open(), registry.open()
    for stream, inner in ((fits, [1, 2, 3]), (over, [1, 2, 3, 4])):
        assert stream.set_sink(DeliversInside(registry, stream.rid, inner, outer))
        assert registry.deliver(stream.rid, "declined") is True
    assert fits.ready() == ["declined", 1, 2, 3]
    assert over.rid not in registry, "5 outputs wait under max_pending=4"
    with pytest.raises(tether.ConsumerTooSlow) as raised:
        over.ready()
    assert raised.value.max_bytes is None  # (the count broke it, not the bytes)
    await aborts.wait_for(1)
    assert aborts.rids == {over.rid}
    registry.deliver(fits.rid, "end", finished=True)
    assert fits.ready() == ["end"]
    await over.aclose()


@pytest.mark.parametrize("merge", [None, operator.add], ids=["appended", "merged"])
@pytest.mark.parametrize("outer", ["declines", "raises"])
async def test_a_declined_sink_keeps_the_byte_budget(
    aborts: AbortLog, outer: str, merge: Any
) -> None:
    """What waits behind a declined output (here, delivered from inside the sink)
    counts against ``max_pending_bytes``, appended or merged: a backlog over the budget
    ends the request as too slow."""
    registry = tether.Registry(aborts, merge=merge, max_pending_bytes=64)
    small, large = registry.open(), registry.open()
    for stream, inner in ((small, "x" * 10), (large, "x" * 100)):
        assert stream.set_sink(DeliversInside(registry, stream.rid, [inner], outer))
        assert registry.deliver(stream.rid, "declined") is True
    small_waiting = ["declined", "x" * 10]
    assert small.ready() == (small_waiting if merge is None else ["".join(small_waiting)])
    assert large.rid not in registry, "100 bytes wait behind the oldest under a 64-byte budget"
    with pytest.raises(tether.ConsumerTooSlow) as raised:
        large.ready()
    assert raised.value.max_bytes == 64
    await aborts.wait_for(1)
    assert aborts.rids == {large.rid}
    await small.aclose()
    await large.aclose()


@pytest.mark.parametrize("outer", ["declines", "raises"])
async def test_a_sink_that_aborts_its_own_request_leaves_nothing_to_read(
    aborts: AbortLog, outer: str
) -> None:
    """A sink that finds the client gone (and aborts the request) before it declines or
    raises: the abort forgets the output it was offered, as it forgets any unread one."""
    registry = tether.Registry(aborts)
    stream = registry.open()

    def sink(outputs: list[Any]) -> bool:
        stream.cancel(tether.AbortReason.CLIENT_DISCONNECTED)
        if outer == "raises":
            raise OSError("transport gone")
        return False

    assert stream.set_sink(sink)
    assert registry.deliver(stream.rid, "offered") is True
    with pytest.raises(tether.Aborted) as raised:
        stream.ready()
    assert raised.value.reason is tether.AbortReason.CLIENT_DISCONNECTED
    await stream.aclose()
    assert aborts.rids == {stream.rid}
