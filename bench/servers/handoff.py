"""The hand-off users write by hand, which issue 26 holds tether to.

Streaming: a dict ``rid -> asyncio.Queue``; the producer puts each output (and an
end marker after the last); the handler awaits the queue, serializes each output
with the request's serializer and writes it as ``data: ...\\n\\n``, then ``data:
[DONE]``, one write per event. JSON: a dict ``rid -> future`` that the producer
resolves with the final output. Neither notices a client that leaves until a
write fails, bounds a slow reader, or sends pings: that is what tether adds, and
it must still cost less.

:data:`SERIALIZERS` are the two the benchmark runs both sides with, by name.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable
from typing import Any, Final

import orjson

from .producer import SSE_DONE, Step

__all__ = ["DONE", "SERIALIZERS", "FutureTable", "QueueTable", "events", "stdlib_dumps"]

DONE: Final = object()
"""What the producer puts after a request's last output."""


def stdlib_dumps(value: Any) -> bytes:
    """``json.dumps`` as users call it (its cached default encoder), as bytes."""
    return json.dumps(value).encode()


SERIALIZERS: Final[dict[str, Callable[[Any], bytes]]] = {
    "orjson": orjson.dumps,
    "stdlib": stdlib_dumps,
}


class QueueTable:
    """``rid -> asyncio.Queue``; closing an unfinished request aborts it.

    :param on_abort: called with the rid of a request closed before it finished.
    """

    def __init__(self, on_abort: Callable[[str], None]) -> None:
        self.queues: dict[str, asyncio.Queue[Any]] = {}
        self._on_abort = on_abort
        self._ids = 0

    def open(self, rid: str | None = None) -> tuple[str, asyncio.Queue[Any]]:
        if rid is None:
            self._ids += 1
            rid = f"q-{self._ids}"
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self.queues[rid] = queue
        return rid, queue

    def deliver(self, rid: str, output: Any, *, finished: bool = False) -> None:
        queue = self.queues.get(rid)
        if queue is not None:
            queue.put_nowait(output)
            if finished:
                queue.put_nowait(DONE)
                del self.queues[rid]

    def deliver_many(self, step: Step) -> None:
        queues = self.queues
        for rid, output, finished in step:
            queue = queues.get(rid)
            if queue is not None:
                queue.put_nowait(output)
                if finished:
                    queue.put_nowait(DONE)
                    del queues[rid]

    def close(self, rid: str) -> None:
        if self.queues.pop(rid, None) is not None:
            self._on_abort(rid)


async def events(
    table: QueueTable, rid: str, queue: asyncio.Queue[Any], dumps: Callable[[Any], bytes]
) -> AsyncGenerator[bytes, None]:
    """One request's SSE body: an event per output as it comes, then ``[DONE]``."""
    try:
        while (output := await queue.get()) is not DONE:
            yield b"data: " + dumps(output) + b"\n\n"
        yield SSE_DONE
    finally:
        table.close(rid)


class FutureTable:
    """``rid -> future`` resolved with the final output; closing an unfinished
    request aborts it.

    :param on_abort: called with the rid of a request closed before it finished.
    """

    def __init__(self, on_abort: Callable[[str], None]) -> None:
        self.futures: dict[str, asyncio.Future[Any]] = {}
        self._on_abort = on_abort
        self._ids = 0

    def open(self, rid: str | None = None) -> tuple[str, asyncio.Future[Any]]:
        if rid is None:
            self._ids += 1
            rid = f"f-{self._ids}"
        future = self.futures[rid] = asyncio.get_running_loop().create_future()
        return rid, future

    def deliver(self, rid: str, output: Any, *, finished: bool = False) -> None:
        if finished:
            future = self.futures.pop(rid, None)
            if future is not None and not future.done():
                future.set_result(output)

    def deliver_many(self, step: Step) -> None:
        futures = self.futures
        for rid, output, finished in step:
            if finished:
                future = futures.pop(rid, None)
                if future is not None and not future.done():
                    future.set_result(output)

    def close(self, rid: str) -> None:
        if self.futures.pop(rid, None) is not None:
            self._on_abort(rid)
