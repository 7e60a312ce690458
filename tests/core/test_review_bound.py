"""Review of fix-bound (6ae9861): a declined sink, an abort, a batch read apart and
``result()``'s fold keep every promise of the mailbox: nothing lost, duplicated or
reordered, every backlog bounded, and no exception reaching the producer."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import tether
from tether.http import Stepped

from .conftest import AbortLog


class _Declines:
    """A sink that, offered its first output, delivers ``inner`` to its own stream (each
    one offered to it again from inside itself, and declined), then declines."""

    def __init__(self, registry: tether.Registry, rid: str, inner: list[Any]) -> None:
        self.registry = registry
        self.rid = rid
        self.inner = inner
        self.offered: list[list[Any]] = []

    def __call__(self, outputs: list[Any]) -> bool:
        self.offered.append(list(outputs))
        if len(self.offered) == 1:
            for output in self.inner:
                self.registry.deliver(self.rid, output)
        return False


def _strict_join(older: Any, newer: Any) -> Any:
    """Joins text; a number after text is a bad output: merge raises."""
    if isinstance(older, str) and not isinstance(newer, str):
        raise TypeError(f"cannot join {newer!r} to text")
    return older + newer


async def test_a_merge_that_raises_in_a_declined_sinks_fold_keeps_the_outputs_before_it(
    aborts: AbortLog,
) -> None:
    """``merge`` raises while ``wait_again`` folds what a re-entrant ``deliver()`` left
    into the declined output: the request fails alone, the producer's step goes on, and
    what stays readable is what was delivered before the failure, in order, as when
    the same ``merge`` raises on the usual path (there ``"outer"`` stays readable and
    the output merge refused is the one lost). Here the declined output, delivered
    first, is lost, and the later one it was being merged with is read instead."""
    registry = tether.Registry(aborts, merge=_strict_join)
    usual, sunk, other = registry.open(), registry.open(), registry.open()
    for stream in (usual, sunk, other):
        registry.deliver(stream.rid, "first")
        assert stream.ready() == ["first"]
    # The usual path: "outer" waits, 7 cannot be merged into it.
    registry.deliver_many([(usual.rid, "outer", False), (usual.rid, 7, False)])
    assert usual.ready() == ["outer"]
    with pytest.raises(tether.ProducerError):
        usual.ready()
    # The declined sink's path, in an engine step that goes on to another request.
    assert sunk.set_sink(_Declines(registry, sunk.rid, [7]))
    assert registry.deliver_many([(sunk.rid, "outer", False), (other.rid, "next", False)]) == 2
    assert other.ready() == ["next"]  # (holds: the step went on)
    assert sunk.rid not in registry
    assert sunk.ready() == ["outer"], "the output delivered first is lost, a later one read"
    with pytest.raises(tether.ProducerError):
        sunk.ready()
    await other.aclose()


def _counting_join(older: dict[str, Any], newer: dict[str, Any]) -> dict[str, Any]:
    """Joins text and counts the outputs folded (as a token count would): ``newer`` is
    one delivered output, as ``put`` and a stream's ``result()`` always hand it."""
    return {"text": older["text"] + newer["text"], "outputs": older.get("outputs", 1) + 1}


async def test_a_declined_sinks_backlog_folds_as_the_same_outputs_fold_without_a_sink() -> None:
    """Outputs delivered from inside a sink that then declines are folded into the
    declined one in delivery order, one delivered output at a time, as ``put`` folds
    the same outputs when no sink was set. ``wait_again`` instead merges
    the inner outputs together first and hands ``merge`` that merged value as
    ``newer``: a merge that counts what it folds (tokens, outputs) under-counts."""
    registry = tether.Registry(merge=_counting_join)
    plain, sunk = registry.open(), registry.open()
    outputs = [{"text": "a"}, {"text": "b"}, {"text": "c"}]
    for stream in (plain, sunk):
        registry.deliver(stream.rid, {"text": ""})
        stream.ready()
    for output in outputs:
        registry.deliver(plain.rid, output)
    expected = plain.ready()
    assert expected == [{"text": "abc", "outputs": 3}]
    assert sunk.set_sink(_Declines(registry, sunk.rid, outputs[1:]))
    registry.deliver(sunk.rid, outputs[0])
    assert sunk.ready() == expected
    await plain.aclose()
    await sunk.aclose()


async def test_a_cancelled_keep_going_batch_result_leaves_no_output_after_its_error() -> None:
    """A keep-going batch whose ``result()`` is cancelled after one sub-request failed:
    what that sub-request delivered before failing is read before its error, never
    after it. ``uncollect`` appends the folded result behind the error pair that
    ``record`` put in the shared list (its comment: "in collect mode nothing else
    waits"), so the batch yields ``(0, ProducerError)`` and then ``(0, "a")``."""
    registry = tether.Registry()
    batch = registry.open_batch(2, keep_going=True)
    failing = batch.rids[0]
    parked = asyncio.Event()

    async def wait_for_result() -> object:
        parked.set()
        return await batch.result()

    async with asyncio.timeout(10):
        reader = asyncio.create_task(wait_for_result())
        await parked.wait()
        registry.deliver(failing, "a")  # folded into the result
        registry.fail(failing, RuntimeError("engine"))
        reader.cancel()
        await asyncio.wait([reader])
    pairs: list[tuple[int, Any]] = []

    async def read_all() -> None:
        async for pair in batch:
            pairs.append(pair)

    with pytest.raises(tether.Aborted):
        await read_all()
    of_failing = [output for index, output in pairs if index == 0]
    assert [type(output) for output in of_failing] == [str, tether.ProducerError], of_failing


def _refuses_bad(older: Any, newer: Any) -> Any:
    if newer == "bad":
        raise TypeError("cannot merge 'bad'")
    return older + newer


async def test_a_merge_that_raises_in_a_batch_results_fold_fails_that_request_and_loses_nothing(
    aborts: AbortLog,
) -> None:
    """``result()`` folds what was delivered but not read (here an output an ``async
    for`` buffered and a newer one): a ``merge`` that raises there fails that request
    (``ProducerError``), as it does in ``deliver()``. Instead the raw ``TypeError``
    escapes ``result()`` into the handler, both requests stay in flight, and the two
    unread outputs are silently gone (a later ``result()`` returns without them)."""
    registry = tether.Registry(aborts, merge=_refuses_bad)
    batch = registry.open_batch(2)
    first, second = batch.rids
    registry.deliver(first, "a")
    registry.deliver(second, "b")
    async with asyncio.timeout(10):
        assert await anext(batch) == (0, "a")  # (1, "b") stays buffered, unread
        registry.deliver(second, "bad")  # waits apart from "b": nothing merges it yet
        with pytest.raises(tether.ProducerError):
            await batch.result()
    assert second not in registry
    await batch.aclose()


async def test_a_sink_that_raises_cancelled_error_spares_the_producer_and_loses_nothing() -> None:
    """A sink's exception never reaches the producer (invariant 10) and the output it
    was offered waits for the reader. ``put`` catches ``Exception`` only: a sink (or a
    send chain under ``Stepped``) raising ``CancelledError`` raises it out of
    ``deliver()`` into the producer's task, loses the output and leaves the sink set."""
    registry = tether.Registry()
    stream = registry.open()
    registry.deliver(stream.rid, "first")
    assert stream.ready() == ["first"]

    def sink(outputs: list[Any]) -> bool:
        raise asyncio.CancelledError()

    assert stream.set_sink(sink)
    registry.deliver(stream.rid, "offered")  # raises CancelledError into the producer
    assert stream.ready() == ["offered"]
    await stream.aclose()


async def test_a_send_step_that_raises_cancelled_error_is_handed_to_the_write_loop() -> None:
    """``Stepped``: "A step that raises hands the error to the write loop the same way:
    it never reaches the producer." A send chain that awaits a future already
    cancelled (a middleware's flow-control future, a finished task) raises
    ``CancelledError`` in the first step; ``write`` catches ``Exception`` only, so it
    reaches ``Exchange._sink``, ``put`` and the producer's ``deliver()``."""
    loop = asyncio.get_running_loop()

    async def write(chunk: bytes, last: bool) -> None:
        gone: asyncio.Future[None] = loop.create_future()
        gone.cancel()
        await gone

    stepped = Stepped(write)
    begun = stepped.write(b"x")  # raises CancelledError here
    assert begun is not True
    assert begun is not False
    with pytest.raises(asyncio.CancelledError):
        await begun  # type: ignore[misc]


async def test_the_byte_budget_bounds_a_backlog_whose_large_outputs_fall_between_weighed_ones(
    aborts: AbortLog,
) -> None:
    """``max_pending_bytes`` bounds what waits "before it holds about twice the budget"
    (``weigh``), whatever the outputs' sizes. ``weigh`` samples one output at 2, 4, 8,
    ... waiting and lets it stand for those since the last: when those are tiny and
    the others large, nothing large is ever weighed. Here 57 kB wait under a 1 kB
    budget (and with 100 kB outputs, ~99 MB wait under 10 kB after 999 outputs)."""
    registry = tether.Registry(aborts, max_pending_bytes=1000, sizeof=len)
    stream = registry.open()
    large = "x" * 1000
    for count in range(1, 65):
        tiny = count & (count - 1) == 0  # the outputs weigh() samples
        registry.deliver(stream.rid, "t" if tiny else large)
    assert stream.rid not in registry, "57 kB wait under a budget of 1 kB"
    await stream.aclose()


async def test_a_sink_that_aborts_its_own_request_tells_on_abort_after_the_producers_step() -> None:
    """A sink may abort its own request (it found the client gone: documented in
    ``set_sink``). It runs inside the producer's ``deliver()``, and ``on_abort`` must
    never re-enter the producer in the middle of its step (``_table``: entered from the
    producer's own call, it runs soon after, on the loop), as it does not for a raising
    ``merge`` or a backlog over a limit. The sink's ``cancel()`` ends the request with
    ``defer=False``: ``on_abort`` runs inside ``deliver_many()``, where an engine's
    ``abort(rid)`` changes the request table its step is iterating over."""
    in_step = False
    told: list[tuple[str, bool]] = []
    called = asyncio.Event()

    def on_abort(rid: str) -> None:
        told.append((rid, in_step))
        called.set()

    registry = tether.Registry(on_abort)
    stream = registry.open()
    registry.deliver(stream.rid, "first")
    assert stream.ready() == ["first"]

    def sink(outputs: list[Any]) -> bool:
        stream.cancel(tether.AbortReason.CLIENT_DISCONNECTED)
        return False

    assert stream.set_sink(sink)
    in_step = True
    registry.deliver_many([(stream.rid, "offered", False)])
    in_step = False
    async with asyncio.timeout(10):
        await called.wait()
    assert told == [(stream.rid, False)], "on_abort ran inside the producer's step"
    await stream.aclose()


async def test_a_merge_that_raises_in_the_fold_of_a_sink_that_finished_its_request_is_not_silent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The sink delivers the request's last output from inside itself (the request
    finishes there), then declines: ``wait_again`` folds that last output into the
    declined one and ``merge`` raises. The request is already over, so
    ``merge_failed`` does nothing, not even log: the reader gets the last output alone
    and a clean end; the declined output is silently gone (counted finished, not failed)."""
    registry = tether.Registry(merge=_strict_join)
    stream = registry.open()
    registry.deliver(stream.rid, "first")
    assert stream.ready() == ["first"]

    def sink(outputs: list[Any]) -> bool:
        registry.deliver(stream.rid, 7, finished=True)
        return False

    assert stream.set_sink(sink)
    registry.deliver(stream.rid, "outer")
    read: list[Any] = []
    failure: BaseException | None = None
    try:
        async for output in stream:
            read.append(output)
    except tether.ProducerError as exc:
        failure = exc
    logged = any("merge() raised" in record.getMessage() for record in caplog.records)
    assert read[:1] == ["outer"] or failure is not None or logged, (
        f"read {read!r}, then a clean end: the output delivered first vanished unseen"
    )
