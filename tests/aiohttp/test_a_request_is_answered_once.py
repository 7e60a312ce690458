"""A request gets one response: ``respond()`` for a request whose response has already
started (a handler that answers twice, in a fallback path) is refused at once with
``RuntimeError`` and writes nothing; the stream it was given is closed, and the
client's next request on the connection gets its own answer."""

from __future__ import annotations

import asyncio
from types import ModuleType
from typing import Any

import tether
from tests._support.raw_http import connection, read_response
from tests._support.servers import serving

BOUND = 10.0


async def _answer(reader: asyncio.StreamReader) -> object:
    """The next whole answer on the connection, or what broke reading it."""
    try:
        return await read_response(reader)
    except (ValueError, asyncio.IncompleteReadError, TimeoutError) as exc:
        return exc


def get(target: str) -> bytes:
    return f"GET {target} HTTP/1.1\r\nhost: test\r\n\r\n".encode()


async def test_a_second_respond_for_a_request_already_answered_is_refused_writing_nothing() -> None:
    registry = tether.Registry()
    outcomes: list[object] = []

    async def endpoint(verbs: ModuleType, request: Any) -> Any:
        if request.query.get("plain"):  # the client's next request
            stream = registry.open()
            registry.deliver(stream.rid, "next", finished=True)
            return await verbs.respond(request, stream, streaming=False)
        first, second = registry.open(), registry.open()
        for stream in (first, second):  # streamed for real: the head goes out with it
            registry.deliver(stream.rid, {"n": 1})
        loop = asyncio.get_running_loop()
        loop.call_soon(lambda: registry.deliver(first.rid, {"n": 2}, finished=True))
        answer = await verbs.respond(request, first, streaming=True)  # written whole
        loop.call_soon(lambda: registry.deliver(second.rid, {"n": 2}, finished=True))
        try:
            outcomes.append(await verbs.respond(request, second, streaming=True))
        except RuntimeError as exc:
            outcomes.append(exc)
        return answer

    async with (
        serving("aiohttp", registry, "GET", "/generate", endpoint) as url,
        connection(url) as (reader, writer),
    ):
        writer.write(get("/generate"))
        first = await _answer(reader)
        writer.write(get("/generate?plain=1"))  # the client's next request on its connection
        following = await _answer(reader)
    assert [type(outcome) for outcome in outcomes] == [RuntimeError], outcomes
    assert first == (200, b'data: {"n":1}\n\ndata: {"n":2}\n\ndata: [DONE]\n\n'), first
    assert following == (200, b'"next"'), f"the next request's answer was {following}"
    assert registry.in_flight == 0
