"""What the Starlette and aiohttp benchmark servers share: the command line, the
backend (producer, hand-written table, tether registry, abort log), the
hand-written batch interleave, and the loopback socket whose port is printed.

Every server exposes the same routes, whatever its framework and variant:

* ``/stream?n=64[&rid=][&shape=step][&json=orjson]``: ``n`` SSE events, then ``data:
  [DONE]``; ``shape`` picks the producer (:data:`~.producer.SHAPES`) and ``json`` the
  serializer (:data:`~.handoff.SERIALIZERS`) on the ``tether`` and ``handoff``
  servers (the others have the engine step and orjson only).
* ``/json?n=64[&rid=][&shape=step][&json=orjson][&watch=1]``: waits for the request's
  final output, answers it as JSON; ``watch=1`` (the Starlette hand-off) with a task
  that reads ``receive`` for the disconnect beside it, as inference servers do.
* ``/batch?b=64&n=64``: ``b`` sub-requests of ``n`` outputs in one SSE stream,
  each event tagged with its ``index``.
* ``/idle``: one event, then an open, silent stream until the client leaves.
* ``/_bench/aborts``: ``{rid: time.monotonic() of its abort}`` since the last call.
* ``/_bench/gc``: the cyclic collector's time and the process CPU so far
  (:class:`~.producer.GcClock`; zero unless the server runs with ``BENCH_GC=1``).

Variants: ``handoff`` (issue 26's hand-off, :mod:`.handoff`: a queue per request
streamed one write per event, a future per JSON request), ``raw`` (the careful
hand-written table: the framework's own streaming response over :class:`RawTable`,
every ready output in one write), ``tether`` (the adapter), ``limit`` (the no-hand-off
limit: the framework's own streaming response yielding pre-built SSE events, one
write per event, no producer at all; ``/stream`` and ``/json`` only), ``poll``
(the polling baseline for disconnects: ``wait_for(event.wait(), timeout=4)`` then
a disconnect check).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import socket
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from typing import Any

import tether

from .handoff import SERIALIZERS, FutureTable, QueueTable
from .producer import (
    SSE_DONE,
    AbortLog,
    Box,
    GcClock,
    Producer,
    RawTable,
    Shape,
    TaskProducer,
    ThreadProducer,
    prebuilt,
    sse_many,
)

__all__ = [
    "POLL_TIMEOUT",
    "VARIANTS",
    "Backend",
    "interleave",
    "limit_events",
    "listen",
    "parse_args",
    "serve",
]

VARIANTS = ("raw", "handoff", "tether", "limit", "poll")

POLL_TIMEOUT = 4.0
"""The polling baseline's wait before it asks whether the client is still there."""


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--variant", choices=VARIANTS, required=True)
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    parser.add_argument("--tick", type=float, default=0.0, help="seconds between producer steps")
    parser.add_argument(
        "--handler-cancellation",
        action="store_true",
        help="aiohttp only: cancel handlers whose client left",
    )
    return parser.parse_args()


def serve(main: Coroutine[Any, Any, None], loop: str) -> None:
    """Run the server's ``main`` on asyncio's own loop or on uvloop's."""
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main)


def listen() -> socket.socket:
    """A listening socket on 127.0.0.1, on a port the OS picks, printed as ``PORT <n>``."""
    # proto must say TCP: asyncio sets TCP_NODELAY on accepted sockets only then, and
    # without it Nagle holds each response's last write for a delayed ACK (40 ms).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(4096)
    sock.setblocking(False)
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    return sock


class Backend:
    """The producers and the tables a server may read them through.

    ``tether`` feeds the registry and ``handoff`` the queue and future tables, from a
    producer of each shape (:meth:`shape`); the others feed the raw table from the
    engine step (``limit`` never starts a request, so its producer stays parked).

    :param variant: the server's variant.
    :param tick: seconds between the engine step's steps.
    """

    def __init__(self, variant: str, tick: float) -> None:
        self.variant = variant
        self.aborts = AbortLog()
        self.gc = GcClock()
        if os.environ.get("BENCH_GC") == "1":
            self.gc.install()
        self.producer = Producer(tick=tick)
        self.raw = RawTable(self.aborted)
        self.registry = tether.Registry(self.aborted)
        self.queues = QueueTable(self.aborted)
        self.futures = FutureTable(self.aborted)
        self.encoders = {name: tether.SSE(dumps=dumps) for name, dumps in SERIALIZERS.items()}
        self._shapes: dict[tuple[str, str], Shape] = {}
        self._threads: list[tuple[ThreadProducer, Callable[[Any], object]]] = []
        if variant == "tether":
            registry = self.registry
            self.producer.sink = registry.deliver_many
            task, thread = TaskProducer(), ThreadProducer()
            task.sink, thread.sink = registry.deliver, registry.deliver_many_threadsafe
            for kind in ("stream", "json"):
                self._shapes.update({("task", kind): task, ("thread", kind): thread})
                self._shapes[("step", kind)] = self.producer
        elif variant == "handoff":
            self.producer.sink = self.queues.deliver_many
            for kind, table in (("stream", self.queues), ("json", self.futures)):
                task, step, thread = TaskProducer(), Producer(tick=tick), ThreadProducer()
                task.sink, step.sink = table.deliver, table.deliver_many
                self._threads.append((thread, table.deliver_many))  # its loop: at start
                step = self.producer if kind == "stream" else step
                self._shapes.update({("task", kind): task, ("step", kind): step})
                self._shapes[("thread", kind)] = thread
        else:
            self.producer.sink = self.raw.deliver_many
            for kind in ("stream", "json"):
                self._shapes[("step", kind)] = self.producer
        unique = {id(p): p for p in [self.producer, *self._shapes.values()]}
        self._producers: list[Shape] = list(unique.values())

    def shape(self, name: str, kind: str = "stream") -> Shape:
        """The producer of shape ``name`` for ``kind`` (``stream`` or ``json``) requests.

        :raises KeyError: this variant has no such producer.
        """
        return self._shapes[(name, kind)]

    def aborted(self, rid: str) -> None:
        """``on_abort`` of every table: stop the work and note when."""
        for producer in self._producers:
            producer.cancel(rid)
        self.aborts.record(rid)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Run every producer for the server's lifetime (their owner cancels them)."""
        loop = asyncio.get_running_loop()
        for thread, deliver_many in self._threads:
            thread.sink = functools.partial(loop.call_soon_threadsafe, deliver_many)
        tasks = [asyncio.create_task(producer.run()) for producer in self._producers]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
            await self.registry.close(drain_timeout=0)


async def raw_sse(raw: RawTable, box: Box) -> AsyncGenerator[bytes, None]:
    """The raw baseline's SSE body for one request: every ready output in one chunk."""
    try:
        while (items := await box.next_ready()) is not None:
            yield sse_many(items)
        yield SSE_DONE
    finally:
        raw.close(box)


async def limit_events(total: int) -> AsyncIterator[bytes]:
    """The no-hand-off limit's SSE body: ``total`` pre-built events, one chunk each
    (as a handler that streams what it already has would), then the terminal one."""
    for event in prebuilt(total):
        yield event
    yield SSE_DONE


async def _outputs(box: Box) -> AsyncIterator[object]:
    """One sub-request's outputs, one per ``__anext__`` (the hand-written waiter)."""
    while (items := await box.next_ready()) is not None:
        for item in items:
            yield item


async def interleave(raw: RawTable, boxes: list[Box]) -> AsyncGenerator[bytes, None]:
    """The common hand-written batch stream: a task per sub-request ``__anext__``,
    re-armed after each output, multiplexed with ``asyncio.wait(FIRST_COMPLETED)``.

    It is generous to itself: all outputs of one wake-up go out in one chunk.
    """
    iterators = [_outputs(box) for box in boxes]
    pending: dict[asyncio.Future[object], int] = {
        asyncio.ensure_future(it.__anext__()): index for index, it in enumerate(iterators)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            ready = []
            for task in done:
                index = pending.pop(task)
                try:
                    output = task.result()
                except StopAsyncIteration:
                    continue
                ready.append({"index": index, **output})  # type: ignore[dict-item]
                pending[asyncio.ensure_future(iterators[index].__anext__())] = index
            if ready:
                yield sse_many(ready)
        yield SSE_DONE
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        for box in boxes:
            raw.close(box)
