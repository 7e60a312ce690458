"""A :class:`tether.TetherError` from a handler becomes its status and JSON body only
while no response has started, on aiohttp as on Starlette: once the handler's own
response went out, the error goes on to the server (which ends the connection), and
no second response is written into the first one's body."""

from __future__ import annotations

import asyncio
from types import ModuleType
from typing import Any

from aiohttp import web

import tether
from tests._support.raw_http import connection
from tests._support.servers import serving

BOUND = 10.0


async def test_a_tether_error_after_the_handlers_response_started_writes_no_second_one() -> None:
    registry = tether.Registry(max_in_flight=1)

    async def endpoint(verbs: ModuleType, request: web.Request) -> Any:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"first part\n")
        blocker = verbs.get_registry(request).open()
        try:
            verbs.get_registry(request).open()  # Overloaded: max_in_flight=1
        finally:
            await blocker.aclose()
        return response

    async with (
        serving("aiohttp", registry, "GET", "/stream", endpoint) as url,
        connection(url) as (reader, writer),
    ):
        writer.write(b"GET /stream HTTP/1.1\r\nhost: test\r\n\r\n")
        async with asyncio.timeout(BOUND):
            head = await reader.readuntil(b"\r\n\r\n")
            rest = b""
            while chunk := await reader.read(65536):
                rest += chunk
                if b"\r\n0\r\n\r\n" in rest or b"HTTP/1.1" in rest:
                    break
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"first part" in rest
    assert b"HTTP/1.1" not in rest, f"a second response inside the body: {rest!r}"
    assert registry.in_flight == 0
