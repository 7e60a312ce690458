"""The in-process producers every benchmark server shares, and the hand-written
request table the raw servers read them through.

A producer stands in for an inference engine, in one of the three shapes servers
have (:data:`SHAPES`): :class:`Producer` is one engine step that hands the next
small JSON output to every live request in one call (``Registry.deliver_many``),
then yields to the loop; :class:`TaskProducer` runs one task per request, handing
over each output on its own (``Registry.deliver``); :class:`ThreadProducer` is an
engine on its own thread that hands each step's outputs to the loop in one
``call_soon_threadsafe`` (``Registry.deliver_many_threadsafe``). The variants of a
server run the same producer; only its sink differs, so a benchmark compares what
sits between the producer and the socket, nothing else.

:class:`RawTable` is the lean table a careful engineer writes by hand: a dict of
mailboxes, a future created only when a reader has to wait, every ready output
handed over at once. It has none of tether's guarantees, which is the point.

:func:`prebuilt` is what the no-hand-off limit servers send instead: the same
events, framed once per process, with no producer behind them.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import orjson

__all__ = [
    "SHAPES",
    "AbortLog",
    "Box",
    "GcClock",
    "Producer",
    "RawTable",
    "Shape",
    "TaskProducer",
    "ThreadProducer",
    "output",
    "prebuilt",
    "prebuilt_result",
    "sse_many",
]

Step = list[tuple[str, Any, bool]]
"""One engine step: ``(rid, output, finished)`` for every live request."""
Sink = Callable[..., object]
"""``sink(rid, output, finished=...)``: ``Registry.deliver`` or a table's ``deliver``."""
SinkMany = Callable[[Step], object]
"""``sink(step)``: ``Registry.deliver_many``, ``Registry.deliver_many_threadsafe``, or
a hand-written table's equivalent."""

SHAPES = ("task", "step", "thread")
"""The producer shapes: one task per request, one engine step on the loop for every
live request, an engine thread handing each step over to the loop."""

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
SSE_DONE = b"data: [DONE]\n\n"


def output(index: int) -> dict[str, Any]:
    """The producer's ``index``-th output of a request (every request gets the same;
    :meth:`Producer.run` spells it inline, and a harness test holds the two equal)."""
    return {"n": index, "delta": "lorem"}


@functools.cache
def prebuilt(total: int) -> tuple[bytes, ...]:
    """The SSE events of a request of ``total`` outputs, framed once, for the
    no-hand-off limit: byte for byte what the producer's outputs become."""
    return tuple(sse_many([output(index)]) for index in range(total))


@functools.cache
def prebuilt_result(total: int) -> bytes:
    """The JSON body of a request of ``total`` outputs (its last), encoded once."""
    return orjson.dumps(output(total - 1))


def sse_many(outputs: list[Any]) -> bytes:
    """Frame outputs as SSE events exactly as ``tether.SSE`` does, for one write."""
    dumps = orjson.dumps
    return b"".join([b"data: " + dumps(item) + b"\n\n" for item in outputs])


class AbortLog:
    """When each request was aborted, on the system-wide monotonic clock.

    The load client reads it back to measure the time from its close to the abort.
    """

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    def record(self, rid: str) -> None:
        self.times.setdefault(rid, time.monotonic())

    def take(self) -> dict[str, float]:
        """Every recorded abort since the last call."""
        times, self.times = self.times, {}
        return times


class GcClock:
    """The time the cyclic garbage collector takes, by ``gc.callbacks``, and the
    process CPU beside it. py-spy cannot show it: a collection runs inside whichever
    allocation tipped the count, and its samples land on that frame. Installed only
    when asked (the servers' ``BENCH_GC`` environment variable), so that the other
    benchmarks time servers without the callback."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self._began = 0.0

    def install(self) -> None:
        gc.callbacks.append(self._on_collection)

    def uninstall(self) -> None:
        gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._began
        self.collections[info["generation"]] += 1

    def read(self) -> dict[str, Any]:
        """Seconds in the collector and collections per generation so far, and the
        process CPU seconds (every thread) at the same moment."""
        return {
            "gc_s": self.seconds,
            "collections": [*self.collections],
            "cpu_s": time.process_time(),
        }


class Shape(Protocol):
    """What a server asks of a producer, whatever its shape."""

    def add(self, rid: str, total: int, *, hold: bool = False) -> None: ...

    def cancel(self, rid: str) -> None: ...

    async def run(self) -> None: ...


class Producer:
    """One engine step on the loop: the next output of every live request in one
    call of ``sink``, then a yield to the loop.

    :param tick: seconds to sleep between steps (0: yield to the loop only).
    """

    def __init__(self, *, tick: float = 0.0) -> None:
        self.tick = tick
        self.sink: SinkMany | None = None
        self._live: dict[str, list[int]] = {}
        self._holding: set[str] = set()
        self._wake = asyncio.Event()

    def add(self, rid: str, total: int, *, hold: bool = False) -> None:
        """Start a request of ``total`` outputs; with ``hold``, the last one does not
        finish it: the request then stays open, silent, until it is cancelled."""
        self._live[rid] = [0, total]
        if hold:
            self._holding.add(rid)
        self._wake.set()

    def cancel(self, rid: str) -> None:
        """Stop working on ``rid`` (the client left); unknown rids are ignored."""
        self._live.pop(rid, None)
        self._holding.discard(rid)

    async def run(self) -> None:
        """Step forever; the server's lifespan owns the task and cancels it."""
        sink = self.sink
        if sink is None:
            raise RuntimeError("Producer.sink must be set before run()")
        live, holding = self._live, self._holding
        while True:
            if not live:
                self._wake.clear()
                await self._wake.wait()
                continue
            sink(_step(live, holding))
            await asyncio.sleep(self.tick)


def _step(live: dict[str, list[int]], holding: set[str]) -> Step:
    """The next output of every live request; the finished ones leave ``live``."""
    step: Step = []
    done: list[str] = []
    for rid, progress in live.items():
        sent, total = progress
        progress[0] = last = sent + 1
        final = last >= total
        # the literal, not output(): one call less per output on the measured path
        step.append((rid, {"n": sent, "delta": "lorem"}, final and rid not in holding))
        if final:
            done.append(rid)
    for rid in done:
        del live[rid]
    return step


class TaskProducer:
    """One task per request, handing over each output on its own, then yielding to
    the loop: the shape of a server whose handler starts its own generation task."""

    def __init__(self) -> None:
        self.sink: Sink | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def add(self, rid: str, total: int, *, hold: bool = False) -> None:
        sink = self.sink
        if sink is None:
            raise RuntimeError("TaskProducer.sink must be set before add()")
        self._tasks[rid] = asyncio.get_running_loop().create_task(self._one(sink, rid, total, hold))

    def cancel(self, rid: str) -> None:
        task = self._tasks.pop(rid, None)
        if task is not None:
            task.cancel()

    async def run(self) -> None:
        """Own the request tasks: on cancellation, cancel and await those still running."""
        try:
            await asyncio.Event().wait()
        finally:
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks)

    async def _one(self, sink: Sink, rid: str, total: int, hold: bool) -> None:
        try:
            last = total - 1
            for sent in range(total):
                sink(rid, {"n": sent, "delta": "lorem"}, finished=sent == last and not hold)
                await asyncio.sleep(0)
        finally:
            self._tasks.pop(rid, None)


class ThreadProducer:
    """An engine on its own thread: each step's outputs go to the loop in one hand-over
    (``sink``, which must be thread-safe), and the next step starts once the loop has
    taken the last one in, as an engine with a bounded output queue does.

    ``add`` and ``cancel`` are called on the loop; the step is built under a lock. The
    thread starts with the first request, so that a server that never uses it has no
    second thread (whose waits a profiler would sample).
    """

    def __init__(self) -> None:
        self.sink: SinkMany | None = None
        self._live: dict[str, list[int]] = {}
        self._holding: set[str] = set()
        self._lock = threading.Condition()
        self._taken = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def add(self, rid: str, total: int, *, hold: bool = False) -> None:
        if self._thread is None:
            sink = self.sink
            if sink is None:
                raise RuntimeError("ThreadProducer.sink must be set before add()")
            loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._engine, args=(sink, loop), daemon=True)
            self._thread.start()
        with self._lock:
            self._live[rid] = [0, total]
            if hold:
                self._holding.add(rid)
            self._lock.notify()

    def cancel(self, rid: str) -> None:
        with self._lock:
            self._live.pop(rid, None)
            self._holding.discard(rid)

    async def run(self) -> None:
        """Own the engine thread: on cancellation, stop it and join it."""
        try:
            await asyncio.Event().wait()
        finally:
            with self._lock:
                self._stopping = True
                self._lock.notify()
            if self._thread is not None:
                await asyncio.to_thread(self._thread.join, 10)

    def _engine(self, sink: SinkMany, loop: asyncio.AbstractEventLoop) -> None:
        live, holding, taken = self._live, self._holding, self._taken
        while True:
            with self._lock:
                while not live and not self._stopping:
                    self._lock.wait()
                if self._stopping:
                    return
                step = _step(live, holding)
            taken.clear()
            try:
                sink(step)
                loop.call_soon_threadsafe(taken.set)
            except RuntimeError:
                return  # the loop closed under us: the server is stopping
            while not taken.wait(0.1):
                if self._stopping:
                    return


class Box:
    """One request's mailbox in the hand-written table."""

    __slots__ = ("collect", "event", "finished", "items", "last", "rid", "waiter")

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.items: list[Any] = []
        self.last: Any = None
        self.collect = False
        self.finished = False
        self.waiter: asyncio.Future[None] | None = None
        self.event: asyncio.Event | None = None  # set only by the polling handlers

    async def next_ready(self) -> list[Any] | None:
        """Every ready output, waiting for one; ``None`` at the end."""
        while True:
            items = self.items
            if items:
                self.items = []
                return items
            if self.finished:
                return None
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter

    async def result(self) -> Any:
        """The last output, once the request finished."""
        self.collect = True
        while not self.finished:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        return self.last


class RawTable:
    """``rid -> Box``, fed by the producer; closing an unfinished box aborts it.

    :param on_abort: called with the rid of a request closed before it finished.
    """

    def __init__(self, on_abort: Callable[[str], None]) -> None:
        self._boxes: dict[str, Box] = {}
        self._on_abort = on_abort
        self._ids = 0

    def open(self, rid: str | None = None) -> Box:
        if rid is None:
            self._ids += 1
            rid = f"raw-{self._ids}"
        box = self._boxes[rid] = Box(rid)
        return box

    def deliver(self, rid: str, output: Any, *, finished: bool = False) -> None:
        box = self._boxes.get(rid)
        if box is None:
            return
        if box.collect:
            box.last = output
            if not finished:
                return  # a reader waiting for the result wakes once, at the end
        else:
            box.items.append(output)
        if finished:
            box.finished = True
            del self._boxes[rid]
        waiter = box.waiter
        if waiter is not None:
            box.waiter = None
            if not waiter.done():
                waiter.set_result(None)
        if box.event is not None:
            box.event.set()

    def deliver_many(self, step: Step) -> None:
        deliver = self.deliver
        for rid, output, finished in step:
            deliver(rid, output, finished=finished)

    def close(self, box: Box) -> None:
        """The handler is done with ``box``: abort it unless it finished."""
        if self._boxes.pop(box.rid, None) is not None:
            self._on_abort(box.rid)
