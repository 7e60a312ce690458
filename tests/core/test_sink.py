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
    one held behind that output, never offered), then declines or raises."""

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
    then declines or raises: both outputs stay readable, the declined one first. The
    inner output is never offered to the sink from inside itself: it waits behind the
    one the sink is being offered."""
    registry = tether.Registry(aborts, merge=merge)
    async with registry.open() as stream:
        calls: list[list[Any]] = []

        def sink(outputs: list[Any]) -> bool:
            calls.append(list(outputs))
            if len(calls) == 1:
                registry.deliver(stream.rid, "inner")  # held behind "outer", not offered
                if outer == "raises":
                    raise RuntimeError("the sink broke")
            return False

        reader = asyncio.create_task(stream.wait_ready(timeout=10))
        await asyncio.sleep(0)  # the reader parks
        assert stream.set_sink(sink)
        assert registry.deliver(stream.rid, "outer") is True
        await asyncio.wait_for(reader, 10)
        assert calls == [["outer"]]
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
    await aborts.wait_for(1)  # (soon after the producer's step: never inside it)
    assert aborts.rids == {stream.rid}


def _strict_join(older: Any, newer: Any) -> Any:
    """Joins text; a number after text is a bad output: merge raises."""
    if isinstance(older, str) and not isinstance(newer, str):
        raise TypeError(f"cannot join {newer!r} to text")
    return older + newer


async def test_a_merge_that_raises_in_a_declined_sinks_fold_keeps_the_outputs_before_it(
    aborts: AbortLog,
) -> None:
    """``merge`` raises while what a ``deliver()`` from inside a declining sink left is
    folded behind the declined output: the request fails alone, the producer's step
    goes on, and what stays readable is what was delivered before the failure, in
    order, as when the same ``merge`` raises without a sink (there ``"outer"`` stays
    readable and the output ``merge`` refused is the one lost)."""
    registry = tether.Registry(aborts, merge=_strict_join)
    usual, sunk, other = registry.open(), registry.open(), registry.open()
    for stream in (usual, sunk, other):
        registry.deliver(stream.rid, "first")
        assert stream.ready() == ["first"]
    # Without a sink: "outer" waits, 7 cannot be merged into it.
    registry.deliver_many([(usual.rid, "outer", False), (usual.rid, 7, False)])
    assert usual.ready() == ["outer"]
    with pytest.raises(tether.ProducerError):
        usual.ready()
    # A declining sink, in an engine step that goes on to another request.
    assert sunk.set_sink(DeliversInside(registry, sunk.rid, [7], "declines"))
    assert registry.deliver_many([(sunk.rid, "outer", False), (other.rid, "next", False)]) == 2
    assert other.ready() == ["next"]  # (the step went on)
    assert sunk.rid not in registry
    assert sunk.ready() == ["outer"]
    with pytest.raises(tether.ProducerError):
        sunk.ready()
    await other.aclose()


def _counting_join(older: dict[str, Any], newer: dict[str, Any]) -> dict[str, Any]:
    """Joins text and counts the outputs folded (as a token count would): ``newer`` is
    one delivered output, as ``put`` and a stream's ``result()`` always hand it."""
    return {"text": older["text"] + newer["text"], "outputs": older.get("outputs", 1) + 1}


async def test_a_declined_sinks_backlog_folds_as_the_same_outputs_fold_without_a_sink() -> None:
    """Outputs delivered from inside a sink that then declines are folded behind the
    declined one in delivery order, one delivered output at a time (``merge(merge(
    declined, i1), i2)``), as ``put`` folds the same outputs when no sink was set: a
    merge that counts what it folds (tokens, outputs) counts the same either way."""
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
    sink = DeliversInside(registry, sunk.rid, outputs[1:], "declines")
    assert sunk.set_sink(sink)
    registry.deliver(sunk.rid, outputs[0])
    assert sunk.ready() == expected
    assert sink.offered == [[outputs[0]]]  # (what it delivered was never offered to it)
    await plain.aclose()
    await sunk.aclose()


async def test_a_merge_that_raises_in_the_fold_of_a_sink_that_finished_its_request_is_not_silent(
    aborts: AbortLog,
) -> None:
    """The sink delivers the request's last output from inside itself, then declines,
    and ``merge`` refuses to fold that last output behind the declined one: the
    request ends once the sink answered, failed as without a sink (the declined
    output, then :class:`~tether.ProducerError`, counted failed, never finished, and
    ``on_abort`` not told: the producer finished it)."""
    registry = tether.Registry(aborts, merge=_strict_join)
    stream = registry.open()
    registry.deliver(stream.rid, "first")
    assert stream.ready() == ["first"]

    def sink(outputs: list[Any]) -> bool:
        registry.deliver(stream.rid, 7, finished=True)
        assert stream.rid in registry  # (the end waits for this sink's answer)
        return False

    assert stream.set_sink(sink)
    registry.deliver(stream.rid, "outer")
    assert stream.rid not in registry
    assert stream.ready() == ["outer"]
    with pytest.raises(tether.ProducerError):
        stream.ready()
    stats = registry.stats()
    assert (stats.finished, stats.failed) == (0, 1)
    await asyncio.sleep(0)
    assert not aborts.calls


async def test_the_last_output_delivered_from_inside_a_sink_ends_the_request_once_it_answers(
    aborts: AbortLog,
) -> None:
    """The sink delivers the request's last output from inside itself: whether it then
    takes or declines the output it was offered, both are read in order and the
    request finishes once, after the sink's answer."""
    registry = tether.Registry(aborts, merge=operator.add)
    for takes in (True, False):
        stream = registry.open()
        registry.deliver(stream.rid, "first")
        assert stream.ready() == ["first"]
        sink = _DeliversLast(registry, stream.rid, takes)
        assert stream.set_sink(sink)
        registry.deliver(stream.rid, "outer")
        assert stream.rid not in registry
        read = [output async for output in stream]
        assert sink.taken + read == (["outer", "last"] if takes else ["outerlast"])
    assert registry.stats().finished == 2
    assert not aborts.calls


class _DeliversLast:
    """A sink that delivers its request's last output from inside itself, then takes
    (or declines) what it was offered."""

    def __init__(self, registry: tether.Registry, rid: str, takes: bool) -> None:
        self.registry = registry
        self.rid = rid
        self.takes = takes
        self.taken: list[Any] = []

    def __call__(self, outputs: list[Any]) -> bool:
        self.registry.deliver(self.rid, "last", finished=True)
        if self.takes:
            self.taken.extend(outputs)
        return self.takes


def _raises_cancelled_error(outputs: list[Any]) -> bool:
    raise asyncio.CancelledError()


def _with_a_cancelled_sink(registry: tether.Registry) -> tether.Stream:
    """A stream past its first output whose sink raises ``CancelledError``."""
    stream = registry.open()
    registry.deliver(stream.rid, "first")
    assert stream.ready() == ["first"]
    assert stream.set_sink(_raises_cancelled_error)
    return stream


async def test_a_sink_that_raises_cancelled_error_spares_the_producer_and_loses_nothing() -> None:
    """A sink's exception never reaches the producer (invariant 10), ``CancelledError``
    included: a sink cannot be cancelled where it runs, so it is its send chain's, not
    a cancellation of the producer's task. The output it was offered waits for the
    reader and the sink is removed."""
    registry = tether.Registry()
    stream = _with_a_cancelled_sink(registry)
    assert registry.deliver(stream.rid, "offered") is True
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
    assert stream.ready() == ["offered"]
    registry.deliver(stream.rid, "next")  # (to the reader: the sink is gone)
    assert stream.ready() == ["next"]
    await stream.aclose()


async def test_a_producer_cancelled_in_its_step_stays_cancelled_when_a_sink_raises() -> None:
    """The other side: the producer's own task was cancelled during its step and a
    sink then raises ``CancelledError``. That cannot be the producer's cancellation (a
    task's ``cancel()`` inside its own synchronous step only marks its next await):
    ``deliver()`` handles it as the sink's, and the producer's cancellation goes on at
    its next await (here, its end). The output offered still waits."""
    registry = tether.Registry()
    stream = _with_a_cancelled_sink(registry)

    async def producer() -> None:
        asyncio.current_task().cancel()  # type: ignore[union-attr]
        registry.deliver(stream.rid, "offered")

    async with asyncio.timeout(10):
        task = asyncio.create_task(producer())
        with pytest.raises(asyncio.CancelledError):
            await task
    assert task.cancelled()
    assert stream.ready() == ["offered"]
    await stream.aclose()


async def test_a_sink_that_aborts_its_own_request_tells_on_abort_after_the_producers_step() -> None:
    """A sink may abort its own request (it found the client gone). It runs inside the
    producer's ``deliver()``, and ``on_abort`` never re-enters the producer in the
    middle of its step: it is called soon after, on the loop, as for a raising
    ``merge`` or a backlog over a limit."""
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


class _Stop(BaseException):
    """A BaseException that is not an Exception (as pytest's own failures are)."""


def _raising(exc: BaseException) -> Any:
    def sink(outputs: list[Any]) -> bool:
        raise exc

    return sink


@pytest.mark.parametrize(
    "exc",
    [_Stop("stop"), KeyboardInterrupt(), SystemExit(1)],
    ids=["base-exception", "keyboard-interrupt", "system-exit"],
)
async def test_the_output_offered_to_a_sink_that_raises_a_base_exception_is_not_lost(
    exc: BaseException,
) -> None:
    """A sink that raises something that is not an ``Exception`` (KeyboardInterrupt,
    SystemExit, a library's own ``BaseException``) may let it go on to the producer,
    but never leaves the request's sink as the "being offered" marker: the output it was
    offered stays readable and the producer's last output ends the request (invariants
    2, 4, 11)."""
    registry = tether.Registry()
    stream = registry.open()
    assert stream.set_sink(_raising(exc))
    with pytest.raises(type(exc)):
        registry.deliver(stream.rid, "a")
    # the producer goes on: its last output ends the request
    registry.deliver(stream.rid, "b", finished=True)
    assert registry.in_flight == 0, "the request never ended: its sink is still the marker"
    assert [output async for output in stream] == ["a", "b"]


async def test_a_stream_whose_sink_raised_a_base_exception_takes_a_sink_again() -> None:
    """The same sink's stream: what it was offered waits for the reader, and a sink set
    again is offered the next outputs."""
    registry = tether.Registry()
    stream = registry.open()
    assert stream.set_sink(_raising(_Stop("stop")))
    with pytest.raises(_Stop):
        registry.deliver(stream.rid, "a")
    stream.set_sink(None)
    assert stream.ready() == ["a"]  # (what it was offered waits for the reader)
    taken: list[Any] = []
    assert stream.set_sink(lambda outputs: taken.extend(outputs) or True)
    registry.deliver(stream.rid, "b")
    assert taken == ["b"], "the new sink is never offered anything: the marker stayed"
    await stream.aclose()


async def test_a_producer_flushing_its_last_step_while_cancelled_delivers_it_to_every_request() -> (
    None
):
    """A sink's ``CancelledError`` is its consumer's and fails that consumer alone
    (invariants 8, 10), even while the producer's task is being cancelled (its
    ``cancelling()`` stays above zero for the whole of its clean-up): a producer that
    flushes its last step then (``except CancelledError: deliver_many(...); raise``, an
    engine's shutdown) delivers it whole, to every request after that sink's too."""
    registry = tether.Registry()
    a, b = registry.open(), registry.open()
    for stream in (a, b):
        registry.deliver(stream.rid, "first")
        assert stream.ready() == ["first"]
    assert a.set_sink(_raises_cancelled_error)
    parked = asyncio.Event()

    async def engine() -> None:
        try:
            parked.set()
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            # shutdown: the step that was computed goes out before the task ends
            registry.deliver_many(
                [
                    (a.rid, "x", False),
                    (b.rid, "y", False),
                    (a.rid, "a-end", True),
                    (b.rid, "b-end", True),
                ]
            )
            raise

    async with asyncio.timeout(10):
        task = asyncio.create_task(engine())
        await parked.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert registry.in_flight == 0, "the step was cut at a's sink: b never got its outputs"
    assert [output async for output in b] == ["y", "b-end"]
    assert [output async for output in a] == ["x", "a-end"]


async def test_a_held_last_output_ends_the_request_when_the_producer_is_cancelled() -> None:
    """A last output delivered from inside a sink ends the request once the sink
    answers, whatever it answers: ``CancelledError`` while the producer's own task is
    being cancelled (its step called ``cancel()`` on it) included (invariants 2, 11)."""
    registry = tether.Registry()
    stream = registry.open()

    def sink(outputs: list[Any]) -> bool:
        registry.deliver(stream.rid, "last", finished=True)  # held behind the offered one
        raise asyncio.CancelledError()

    assert stream.set_sink(sink)

    async def engine() -> None:
        asyncio.current_task().cancel()  # type: ignore[union-attr]  (its step cancels itself)
        registry.deliver(stream.rid, "x")

    async with asyncio.timeout(10):
        with pytest.raises(asyncio.CancelledError):
            await asyncio.create_task(engine())
    assert registry.in_flight == 0, "the producer's last output was delivered; the request lives on"
    assert [output async for output in stream] == ["x", "last"]


@pytest.mark.parametrize("many", [False, True], ids=["deliver", "deliver_many"])
async def test_a_held_last_output_ends_the_request_when_the_sink_raises_a_base_exception(
    many: bool,
) -> None:
    """The same with a sink that raises a ``BaseException``: it goes on to the producer,
    and the request ends all the same."""
    registry = tether.Registry()
    stream = registry.open()
    registry.deliver(stream.rid, "first")
    assert stream.ready() == ["first"]

    def sink(outputs: list[Any]) -> bool:
        registry.deliver(stream.rid, "last", finished=True)  # held behind the offered one
        raise KeyboardInterrupt

    assert stream.set_sink(sink)
    step = (
        (lambda: registry.deliver_many([(stream.rid, "x", False)]))
        if many
        else (lambda: registry.deliver(stream.rid, "x"))
    )
    with pytest.raises(KeyboardInterrupt):
        step()
    assert registry.in_flight == 0, "the producer's last output was delivered; the request lives on"
    assert [output async for output in stream] == ["x", "last"]


# A sink's BaseException goes on to the producer (CHANGELOG: "lets it go on to the
# producer with the request whole"), whatever the fold of the held outputs does.


def _merge_refusing_held(acc: Any, new: Any) -> Any:
    raise ValueError("merge refuses")


@pytest.mark.parametrize("many", [False, True], ids=["deliver", "deliver_many"])
@pytest.mark.parametrize(
    "exc", [KeyboardInterrupt, SystemExit], ids=["keyboard-interrupt", "system-exit"]
)
async def test_a_sinks_keyboard_interrupt_reaches_the_producer_even_when_merge_raises_on_the_held_outputs(  # noqa: E501
    many: bool, exc: type[BaseException]
) -> None:
    """A sink that delivers to its own stream (held behind the offered output) and then
    raises KeyboardInterrupt: put() folds the held output in its ``except BaseException``
    block (``offered(output, sink, False)``); a ``merge`` that raises there replaces the
    KeyboardInterrupt, and deliver()'s ``except Exception`` (merge_failed) swallows it:
    the producer never sees the interrupt (invariant 10: nothing escapes silently)."""
    registry = tether.Registry(merge=_merge_refusing_held)
    stream = registry.open()
    registry.deliver(stream.rid, "first")
    assert stream.ready() == ["first"]

    def sink(outputs: list[Any]) -> bool:
        registry.deliver(stream.rid, "held")  # held behind the offered one, unfolded
        raise exc()

    assert stream.set_sink(sink)
    step = (
        (lambda: registry.deliver_many([(stream.rid, "x", False)]))
        if many
        else (lambda: registry.deliver(stream.rid, "x"))
    )
    raised: BaseException | None = None
    try:
        step()
    except BaseException as e:
        raised = e
    assert isinstance(raised, exc), (
        f"the sink's {exc.__name__} never reached the producer: deliver returned normally "
        f"(raised={raised!r}); merge's ValueError replaced it and was handled as a merge failure"
    )
    await stream.aclose()


# A merge that raises a BaseException (KeyboardInterrupt) while the outputs held behind
# a sink's offer are folded (RequestState.offered) goes on to the producer, but must
# leave the request whole: it does not end as a success that lacks the later outputs.


def _merge_interrupting_held(acc: list[str], new: list[str]) -> list[str]:
    if new == ["boom"]:
        raise KeyboardInterrupt
    return acc + new


async def test_a_merges_keyboard_interrupt_while_folding_held_outputs_drops_no_later_output() -> (
    None
):
    registry = tether.Registry(merge=_merge_interrupting_held)
    stream = registry.open()
    registry.deliver(stream.rid, ["first"])
    assert stream.ready() == [["first"]]

    def sink(outputs: list[Any]) -> bool:
        registry.deliver(stream.rid, ["boom"])  # held behind the offered one
        registry.deliver(stream.rid, ["last"], finished=True)  # held: the producer's last
        return False  # declines: offered() folds ["x"], ["boom"], ["last"]

    assert stream.set_sink(sink)
    interrupted = False
    try:
        registry.deliver(stream.rid, ["x"])
    except KeyboardInterrupt:
        interrupted = True
    assert interrupted  # (it goes on to the producer: documented)
    read: list[Any] = []
    error: BaseException | None = None
    try:
        async for output in stream:
            read.append(output)
    except tether.TetherError as exc:
        error = exc
    flat = [item for output in read for item in output]
    assert error is not None or "last" in flat, (
        f"the request ended as a success without the producer's last output: read {read!r}; "
        "the held outputs after the one merge raised on were dropped (invariant 4)"
    )
