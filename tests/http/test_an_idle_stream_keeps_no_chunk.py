"""An idle stream (its outputs written, nothing since) keeps no chunk it wrote, on both
adapters, on real servers: a server holds thousands of idle streams, and a chunk may be
large (all that was ready at once)."""

from __future__ import annotations

import asyncio
import gc
from types import ModuleType
from typing import Any

import pytest

import tether
from tests._support.raw_http import connection, request
from tests._support.servers import ADAPTERS, serving

pytestmark = pytest.mark.parametrize("name", ADAPTERS)

SIZE = 200_000
"""An output's bytes: far larger than any client read, so only a chunk holds it whole."""


def holders_of_a_written_chunk() -> list[str]:
    """The types of the objects that hold an SSE chunk of a large output (the server's)."""
    gc.collect()
    return [
        type(holder).__name__
        for holder in gc.get_objects()
        for held in gc.get_referents(holder)
        if type(held) is bytes and len(held) > SIZE and held.startswith(b"data: {")
    ]


async def read_past(reader: asyncio.StreamReader, got: bytes, end: bytes) -> bytes:
    async with asyncio.timeout(10):
        while end not in got:
            got += await reader.read(65536)
    return got


async def test_an_idle_stream_keeps_no_chunk_it_wrote(name: str) -> None:
    registry = tether.Registry()
    rids: list[str] = []

    async def endpoint(verbs: ModuleType, framework_request: Any) -> Any:
        source = verbs.get_registry(framework_request).open()
        rids.append(source.rid)
        # ready before the answer: the first chunk, written with the head
        assert registry.deliver(source.rid, {"first": "f" * SIZE})
        return await verbs.respond(framework_request, source, streaming=True)

    async with (
        serving(name, registry, "GET", "/stream", endpoint) as url,
        connection(url) as (reader, writer),
    ):
        writer.write(request("GET", "/stream"))
        got = await read_past(reader, b"", b"f" * 64 + b'"}\n\n')
        assert holders_of_a_written_chunk() == []
        assert registry.deliver(rids[0], {"second": "s" * SIZE})
        got = await read_past(reader, got, b"s" * 64 + b'"}\n\n')
        assert holders_of_a_written_chunk() == []
        assert registry.deliver(rids[0], {"n": 1}, finished=True)
        await read_past(reader, got, b"[DONE]")
