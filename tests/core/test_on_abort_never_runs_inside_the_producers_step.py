"""``on_abort`` never re-enters the producer in the middle of its step, whatever ends
the request: the table's rule is that an abort decided while a producer's call runs
(``deliver``, ``deliver_many``, ``fail``, ``fail_all``, and whatever they run: sinks,
``merge``, observers) has its ``on_abort`` called soon after, on the loop, in the order
the requests ended, exactly once, with the counters adding up when it is told."""

from __future__ import annotations

import asyncio
import logging
import operator
import threading
from collections.abc import Callable
from typing import Any

import pytest

import tether


class Producer:
    """An engine whose ``on_abort`` must not run while one of its calls into the
    registry runs; each time it is told, it checks that the counters add up."""

    def __init__(self, **options: Any) -> None:
        self.registry = tether.Registry(self.on_abort, **options)
        self.in_step = 0
        self.inside: list[str] = []
        self.after: list[str] = []
        self.unbalanced: list[str] = []
        self.also: Callable[[str], None] | None = None  # more work on each abort
        self._changed: asyncio.Event | None = None

    def on_abort(self, rid: str) -> None:
        (self.inside if self.in_step else self.after).append(rid)
        stats = self.registry.stats()
        ended = stats.finished + stats.failed + sum(stats.aborted.values())
        if stats.opened != ended + stats.in_flight:
            self.unbalanced.append(rid)
        if self._changed is not None:
            self._changed.set()
        if self.also is not None:
            self.also(rid)

    def step(self, call: Callable[..., object], *args: Any) -> None:
        """One of the producer's calls into the registry: its step."""
        self.in_step += 1
        try:
            call(*args)
        finally:
            self.in_step -= 1

    async def told(self, count: int) -> list[str]:
        """Wait (bounded) until ``count`` calls were told; the rids told after a step."""
        async with asyncio.timeout(10):
            while len(self.inside) + len(self.after) < count:
                self._changed = asyncio.Event()
                await self._changed.wait()
        assert self.inside == [], "on_abort re-entered the producer inside its step"
        assert self.unbalanced == [], "the counters did not add up when on_abort was told"
        return self.after


async def test_a_sink_that_disconnects_its_scope_defers_every_on_abort_past_the_step() -> None:
    engine = Producer()
    registry = engine.registry
    scope = tether.RequestScope()
    with scope:
        a, b = registry.open(), registry.open()

        def sink(outputs: list[Any]) -> bool:
            scope.disconnect()  # the transport is gone: the whole request is over
            return False

        assert a.set_sink(sink)
        engine.step(registry.deliver_many, [(a.rid, "x", False), (b.rid, "y", False)])
        assert registry.in_flight == 0
        assert engine.inside == [], "on_abort re-entered the producer inside its step"
    assert await engine.told(2) == [a.rid, b.rid]


def _cancels_a_stream(registry: tether.Registry) -> tuple[list[str], Callable[[], object]]:
    victim = registry.open()
    return [victim.rid], victim.cancel


def _aborts_a_rid(registry: tether.Registry) -> tuple[list[str], Callable[[], object]]:
    victim = registry.open()
    return [victim.rid], lambda: registry.abort(victim.rid)  # (returns before on_abort)


def _cancels_a_batch(registry: tether.Registry) -> tuple[list[str], Callable[[], object]]:
    victim = registry.open_batch(3)
    return list(victim.rids), victim.cancel


@pytest.mark.parametrize(
    "ends",
    [_cancels_a_stream, _aborts_a_rid, _cancels_a_batch],
    ids=["cancels-a-stream", "aborts-a-rid", "cancels-a-batch"],
)
async def test_a_sink_that_ends_other_requests_defers_their_on_abort_past_the_step(
    ends: Callable[[tether.Registry], tuple[list[str], Callable[[], object]]],
) -> None:
    engine = Producer()
    registry = engine.registry
    a = registry.open()
    victims, end = ends(registry)

    def sink(outputs: list[Any]) -> bool:
        end()
        return True

    assert a.set_sink(sink)
    engine.step(registry.deliver_many, [(a.rid, "x", False)])
    assert not any(rid in registry for rid in victims)
    assert await engine.told(len(victims)) == victims
    await a.aclose()
    assert registry.in_flight == 0


async def test_a_merge_that_cancels_another_stream_defers_its_on_abort_past_the_step() -> None:
    cancel: list[tether.Stream] = []

    def merge(older: Any, newer: Any) -> Any:
        while cancel:
            cancel.pop().cancel()
        return older + newer

    engine = Producer(merge=merge)
    registry = engine.registry
    a, b = registry.open(), registry.open()
    registry.deliver(a.rid, 1)  # waits unread: the next one is merged into it
    cancel.append(b)
    engine.step(registry.deliver_many, [(a.rid, 2, False)])
    assert await engine.told(1) == [b.rid]
    assert a.ready() == [3]
    await a.aclose()
    assert registry.in_flight == 0


class _CancelsAtFirstOutput(tether.Observer):
    """An observer that cancels a stream when a given request's first output arrives."""

    def __init__(self, victims: dict[str, tether.Stream]) -> None:
        self.victims = victims

    def on_first_output(self, rid: str, elapsed: float) -> None:
        victim = self.victims.pop(rid, None)
        if victim is not None:
            victim.cancel()


@pytest.mark.parametrize("whose", ["its-own", "another"])
async def test_an_observer_that_cancels_a_stream_at_a_first_output_defers_on_abort_past_the_step(
    whose: str,
) -> None:
    engine = Producer()
    registry = engine.registry
    a, b = registry.open(), registry.open()
    victim = a if whose == "its-own" else b
    registry.add_observer(_CancelsAtFirstOutput({a.rid: victim}))
    engine.step(registry.deliver, a.rid, "x")
    assert await engine.told(1) == [victim.rid]
    await a.aclose()
    await b.aclose()
    assert registry.in_flight == 0


class _CancelsAtEnd(tether.Observer):
    """An observer that cancels a stream when a given request ends."""

    def __init__(self, trigger: str, victim: tether.Stream) -> None:
        self.trigger = trigger
        self.victim = victim

    def on_end(self, end: tether.RequestEnd) -> None:
        if end.rid == self.trigger:
            self.victim.cancel()


@pytest.mark.parametrize("how", ["finished", "failed", "fail_all"])
async def test_an_observer_that_cancels_a_stream_as_one_ends_defers_on_abort_past_the_step(
    how: str,
) -> None:
    engine = Producer()
    registry = engine.registry
    a, b = registry.open(), registry.open()
    registry.add_observer(_CancelsAtEnd(a.rid, b))
    if how == "finished":
        engine.step(registry.deliver_many, [(a.rid, "last", True)])
    elif how == "failed":
        engine.step(registry.fail, a.rid, RuntimeError("engine"))
    else:
        engine.step(registry.fail_all, RuntimeError("engine crashed"))
    assert await engine.told(1) == [b.rid]
    await a.aclose()
    await b.aclose()
    assert registry.in_flight == 0


async def test_an_on_abort_that_steps_the_engine_has_what_that_step_ends_told_after_it() -> None:
    """An ``on_abort`` that steps the engine again, whose step ends another request, and
    so on: each is told after the step that ended it, once, in order, never nested in
    the one before (a chain as long as the requests are many costs no stack)."""
    engine = Producer()
    registry = engine.registry
    driver = registry.open()
    victims = [registry.open() for _ in range(300)]
    queue = list(victims)

    def sink(outputs: list[Any]) -> bool:
        if queue:
            queue.pop(0).cancel()
        return True

    assert driver.set_sink(sink)
    engine.also = lambda rid: engine.step(registry.deliver, driver.rid, rid)
    engine.step(registry.deliver, driver.rid, "start")
    assert await engine.told(len(victims)) == [victim.rid for victim in victims]
    await driver.aclose()
    assert registry.in_flight == 0


async def test_a_step_handed_over_from_another_thread_has_on_abort_told_after_the_whole_step() -> (
    None
):
    events: list[tuple[str, str]] = []
    told = asyncio.Event()

    def on_abort(rid: str) -> None:
        events.append(("told", rid))
        told.set()

    registry = tether.Registry(on_abort)
    a, b, c = registry.open(), registry.open(), registry.open()

    def sink_a(outputs: list[Any]) -> bool:
        events.append(("sink", a.rid))
        b.cancel()
        return True

    def sink_c(outputs: list[Any]) -> bool:
        events.append(("sink", c.rid))
        return True

    assert a.set_sink(sink_a)
    assert c.set_sink(sink_c)
    step = [(a.rid, "x", False), (c.rid, "y", False)]
    worker = threading.Thread(target=registry.deliver_many_threadsafe, args=(step,))
    worker.start()
    async with asyncio.timeout(10):
        await told.wait()
    await asyncio.to_thread(worker.join)
    assert events == [("sink", a.rid), ("sink", c.rid), ("told", b.rid)]
    await a.aclose()
    await c.aclose()
    assert registry.in_flight == 0


class _Stop(BaseException):
    """A BaseException that is not an Exception (as pytest's own failures are)."""


@pytest.mark.parametrize(
    "exc", [_Stop("stop"), KeyboardInterrupt()], ids=["base-exception", "keyboard-interrupt"]
)
async def test_the_on_abort_calls_of_a_step_cut_by_a_base_exception_are_each_told_once_after_it(
    exc: BaseException,
) -> None:
    engine = Producer()
    registry = engine.registry
    a, b, c, d = (registry.open() for _ in range(4))

    def sink(outputs: list[Any]) -> bool:
        c.cancel()
        b.cancel()
        raise exc

    assert a.set_sink(sink)
    with pytest.raises(type(exc)):
        engine.step(registry.deliver, a.rid, "x")
    assert await engine.told(2) == [c.rid, b.rid]
    # the producer's call is over: an abort from outside any step is told at once
    assert registry.abort(d.rid)
    assert engine.after == [c.rid, b.rid, d.rid]
    await a.aclose()
    assert registry.in_flight == 0


async def test_an_on_abort_that_raises_after_the_step_is_logged_as_when_told_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = Producer(merge=operator.add)
    registry = engine.registry

    def fails(rid: str) -> None:
        raise RuntimeError("engine unreachable")

    engine.also = fails
    loop_errors: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: loop_errors.append(context))
    a, b = registry.open(), registry.open()
    assert a.set_sink(lambda outputs: b.cancel())
    with caplog.at_level(logging.ERROR, logger="tether"):
        engine.step(registry.deliver, a.rid, 1)  # nothing raised into the producer
        assert await engine.told(1) == [b.rid]
        await a.aclose()
    assert loop_errors == []
    logged = [r.getMessage() for r in caplog.records if "on_abort" in r.getMessage()]
    assert logged == [
        f"on_abort({b.rid!r}) raised; the request was freed anyway",
        f"on_abort({a.rid!r}) raised; the request was freed anyway",
    ]
    assert registry.in_flight == 0
