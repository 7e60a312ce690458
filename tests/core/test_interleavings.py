"""Random interleavings of producer, consumer, scope and server steps keep invariants 1-5.

Hypothesis draws a few single requests and batches, a registry with or without
``merge``, a small ``max_pending`` (so that consumers do fall behind), a plain or
eager-task loop, and a sequence of steps: producer deliveries, finishes and
failures; consumer reads (advance, next_ready, result), closes and cancellations
(of the stream and of the reading task); scope disconnects; server aborts; and
turns of the event loop, which let the reading tasks run in between.

Every output is a 1-tuple holding a global counter and ``merge`` concatenates
tuples, so the flattened outputs a consumer received can be compared with what
the producer delivered, merged or not. After every consumer is closed:

1. a consumer that reached the end of a finished request got every output;
2. nothing is left in flight;
3. ``on_abort`` ran exactly once for every request the producer did not end,
   never for one it finished or failed;
4. what each consumer received is the delivered sequence's prefix, in order,
   each output once, and a batch's outputs came in arrival order;
5. producer calls for rids no longer in flight returned ``False`` and were counted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import operator
from collections import Counter
from collections.abc import Iterable
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

import tether

from ._eager import new_eager_loop

_step = st.one_of(
    st.tuples(st.just("deliver"), st.integers(0, 11), st.booleans()),
    st.tuples(st.just("fail"), st.integers(0, 11)),
    st.tuples(st.just("abort"), st.integers(0, 11)),
    st.tuples(st.just("read"), st.integers(0, 4), st.sampled_from(["advance", "ready", "result"])),
    st.tuples(st.just("close"), st.integers(0, 4), st.sampled_from(["aclose", "cancel", "task"])),
    st.tuples(st.just("disconnect"), st.integers(0, 1)),
    st.tuples(st.just("yield")),
)


@dataclasses.dataclass
class Program:
    singles: int
    batches: list[tuple[int, bool]]
    merge: bool
    max_pending: int
    eager: bool
    steps: list[tuple[Any, ...]]


_programs = st.builds(
    Program,
    singles=st.integers(1, 3),
    batches=st.lists(st.tuples(st.integers(1, 3), st.booleans()), max_size=2),
    merge=st.booleans(),
    max_pending=st.integers(1, 4),
    eager=st.booleans(),
    steps=st.lists(_step, max_size=60),
)


class Run:
    """One program against a fresh registry, with the model it is checked against."""

    def __init__(self, program: Program) -> None:
        self.program = program
        self.aborts: Counter[str] = Counter()
        self.registry = tether.Registry(
            self._on_abort,
            merge=operator.add if program.merge else None,
            max_pending=program.max_pending,
        )
        self.scopes = [tether.RequestScope(), tether.RequestScope()]
        self.consumers: list[tether.Stream | tether.Batch] = []
        self.rids_of: list[tuple[str, ...]] = []
        self.delivered: dict[str, list[int]] = {}
        self.received: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.failed: set[str] = set()
        self.reached_end: set[int] = set()
        self.closed: set[int] = set()
        self.done: set[int] = set()
        self.readers: dict[int, asyncio.Task[None]] = {}
        self.arrivals: dict[int, list[int]] = {}
        self.late = 0
        self.counter = 0

    def _on_abort(self, rid: str) -> None:
        self.aborts[rid] += 1

    def _adopt(self, consumer: tether.Stream | tether.Batch, rids: tuple[str, ...]) -> None:
        self.scopes[len(self.consumers) % 2].track(consumer)
        self.consumers.append(consumer)
        self.rids_of.append(rids)
        self.arrivals[len(self.consumers) - 1] = []
        for rid in rids:
            self.delivered[rid] = []
            self.received[rid] = []

    @property
    def all_rids(self) -> list[str]:
        return [rid for rids in self.rids_of for rid in rids]

    async def main(self) -> None:
        for _ in range(self.program.singles):
            stream = self.registry.open()
            self._adopt(stream, (stream.rid,))
        for size, keep_going in self.program.batches:
            batch = self.registry.open_batch(size, keep_going=keep_going)
            self._adopt(batch, batch.rids)
        for step in self.program.steps:
            await self.step(*step)
        self.closed.update(range(len(self.consumers)))
        for scope in self.scopes:
            scope.close()
        for consumer in self.consumers:
            await consumer.aclose()
        async with asyncio.timeout(10):
            outcomes = await asyncio.gather(*self.readers.values(), return_exceptions=True)
        for outcome in outcomes:
            assert outcome is None or isinstance(outcome, asyncio.CancelledError), outcome
        await asyncio.sleep(0)  # one loop turn runs on_abort calls deferred out of deliver()

    async def step(self, kind: str, *args: Any) -> None:
        if kind in ("deliver", "fail", "abort"):
            self.produce(kind, *args)
        elif kind == "read":
            index, op = args
            index %= len(self.consumers)
            reader = self.readers.get(index)
            if index not in self.done and (reader is None or reader.done()):
                self.readers[index] = asyncio.ensure_future(self.read(index, op))
        elif kind == "close":
            index, how = args
            index %= len(self.consumers)
            if how == "aclose":
                self.closed.add(index)
                self.done.add(index)
                await self.consumers[index].aclose()
            elif how == "cancel":
                self.consumers[index].cancel()
            elif (reader := self.readers.get(index)) is not None:
                reader.cancel()
        elif kind == "disconnect":
            self.scopes[args[0]].disconnect()
        else:
            await asyncio.sleep(0)  # a turn of the loop: the readers run

    def produce(self, kind: str, target: int, finished: bool = False) -> None:
        registry = self.registry
        rid = self.all_rids[target % len(self.all_rids)]
        live = rid in registry
        if not live:
            self.late += 1
        if kind == "deliver":
            self.counter += 1
            assert registry.deliver(rid, (self.counter,), finished=finished) is live
            if live:
                self.delivered[rid].append(self.counter)
                if finished:
                    # The producer is done with it, even if a lagging consumer makes it
                    # end with ConsumerTooSlow: it is never reported to on_abort.
                    self.finished.add(rid)
        elif kind == "fail":
            assert registry.fail(rid, RuntimeError("engine error")) is live
            if live:
                self.failed.add(rid)
        else:
            assert registry.abort(rid) is live

    async def read(self, index: int, op: str) -> None:
        consumer = self.consumers[index]
        try:
            if op == "advance":
                self.record(index, [await anext(consumer)])
            elif op == "ready":
                items = await consumer.next_ready()
                if items is None:
                    self.end(index)
                else:
                    self.record(index, items)
            else:
                result = await consumer.result()
                results = result if isinstance(consumer, tether.Batch) else [result]
                for rid, value in zip(self.rids_of[index], results, strict=True):
                    self.record_result(rid, value)
                self.end(index)
        except StopAsyncIteration:
            self.end(index)
        except (tether.Aborted, tether.ProducerError):
            self.done.add(index)

    def end(self, index: int) -> None:
        self.done.add(index)
        if index not in self.closed:
            self.reached_end.add(index)

    def record(self, index: int, items: Iterable[Any]) -> None:
        rids = self.rids_of[index]
        batch = isinstance(self.consumers[index], tether.Batch)
        for item in items:
            rid, output = (rids[item[0]], item[1]) if batch else (rids[0], item)
            if isinstance(output, tether.TetherError):  # keep_going: the error in its place
                continue
            if batch:
                self.arrivals[index].append(output[0])
            self.received[rid].extend(output)

    def record_result(self, rid: str, value: Any) -> None:
        if value is None or isinstance(value, tether.TetherError):
            return
        if self.program.merge:
            self.received[rid].extend(value)
        else:
            assert value == (self.delivered[rid][-1],)  # without merge: the last output
            self.received[rid] = list(self.delivered[rid])

    def check(self) -> None:
        registry = self.registry
        assert registry.in_flight == 0
        ended_by_producer = self.finished | self.failed
        assert set(self.aborts) == set(self.all_rids) - ended_by_producer
        assert all(calls == 1 for calls in self.aborts.values()), self.aborts
        stats = registry.stats()
        assert stats.late_outputs == self.late
        assert stats.opened == len(self.all_rids)
        assert stats.finished + stats.failed + stats.aborted_total == stats.opened
        for index, rids in enumerate(self.rids_of):
            for rid in rids:
                got, sent = self.received[rid], self.delivered[rid]
                assert got == sent[: len(got)], (rid, got, sent)
                if index in self.reached_end and rid in self.finished:
                    assert got == sent, (rid, got, sent)
            arrivals = self.arrivals[index]
            assert arrivals == sorted(set(arrivals))


@settings(max_examples=500, deadline=None)
@given(_programs)
def test_random_interleavings_keep_invariants_1_to_5(program: Program) -> None:
    run = Run(program)
    factory = new_eager_loop if program.eager else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(run.main())
    run.check()
