"""A ``Writer.direct()`` object needs only the ``Direct`` protocol: ``writable()`` and
``write()``. The exchange must not fail the response because asking that object for
anything else raises: a proxy or wrapper whose ``__getattr__`` looks names up in a
table (``KeyError``), or refuses what it does not know with its own error, is a
``Direct`` all the same, and its response gets every event, once, in order, then the
terminal frame.
"""

from __future__ import annotations

import asyncio
from typing import Any

import tether
import tether.http
from tests._support.direct_writes import DirectTransport, DirectWriter, sse_values


class KnowsOnlyItsOwn(DirectTransport):
    """A Direct whose other attributes come from a table: unknown names raise KeyError."""

    _table: dict[str, Any] = {}  # noqa: RUF012 (a class-level lookup table)

    def __getattr__(self, name: str) -> Any:
        return self._table[name]


async def test_a_direct_writer_that_only_knows_its_own_methods_gets_every_event() -> None:
    registry = tether.Registry()
    stream = registry.open()
    exchange = tether.http.Exchange(stream, streaming=True)
    registry.deliver(stream.rid, "first")
    head = await exchange.start()
    writer = DirectWriter(KnowsOnlyItsOwn())
    running = asyncio.ensure_future(exchange.run(writer, head.body))
    async with asyncio.timeout(10):
        # parked with the sink set, or (the defect) the run already failed
        asked = asyncio.ensure_future(writer.sink.asked.wait())
        await asyncio.wait([asked, running], return_when=asyncio.FIRST_COMPLETED)
        asked.cancel()
        if not running.done():
            for n in range(5):
                registry.deliver(stream.rid, n)
            registry.deliver(stream.rid, 5, finished=True)
        await running
    assert sse_values(writer.body()) == ["first", 0, 1, 2, 3, 4, 5, "[DONE]"]
    assert len(writer.sink.written) == 5  # (the producer's step wrote them)
