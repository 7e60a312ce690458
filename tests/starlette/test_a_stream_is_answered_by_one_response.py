"""A response takes a stream once: on Starlette ``respond()`` returns its response
before it runs, and a second ``respond()`` on the same stream meanwhile is refused at
once (``RuntimeError``); the first response keeps the stream and writes every output,
once, in order."""

from __future__ import annotations

from typing import Any

import httpx
from starlette.requests import Request

import tether
from tests._support.servers import serving


async def test_a_second_respond_on_a_stream_a_response_owns_is_refused_and_loses_nothing() -> None:
    registry = tether.Registry()
    refused: list[BaseException] = []

    async def endpoint(verbs: Any, request: Request) -> Any:
        stream = registry.open()
        registry.deliver(stream.rid, {"n": 1})
        first = await verbs.respond(request, stream, streaming=True)  # owns the stream now
        registry.deliver(stream.rid, {"n": 2})
        registry.deliver(stream.rid, {"n": 3}, finished=True)
        try:
            await verbs.respond(request, stream, streaming=True)  # misuse: the same stream
        except RuntimeError as exc:
            refused.append(exc)
        return first

    async with (
        serving("starlette", registry, "POST", "/generate", endpoint) as url,
        httpx.AsyncClient(timeout=10) as client,
    ):
        response = await client.post(f"{url}/generate")
    assert registry.in_flight == 0
    events = [line for line in response.text.split("\n\n") if line]
    assert refused, f"the second respond() was accepted; the client got {events}"
    assert events == ['data: {"n":1}', 'data: {"n":2}', 'data: {"n":3}', "data: [DONE]"]
